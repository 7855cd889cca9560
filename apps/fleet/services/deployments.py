"""Changes of what a pool or a node must serve: deployments, each audited, carried out by the
reconcile that follows."""

from datetime import datetime

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.accounts.permissions import MOVING_BACK, authorize, second_person
from apps.audit.context import REQUEST_ID
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, Node, NodePool, Release
from apps.fleet.owners import owner_holding
from apps.fleet.tasks import reconcile_change
from apps.registry.models import Model, ModelVersion


def reconcile_later(node_ids: list[int]) -> None:
    # Robust: with the broker away the change is committed all the same (never a 500), and the
    # periodic reconcile carries it out.
    transaction.on_commit(lambda: reconcile_change(node_ids), robust=True)


def _deployment_target(
    *, model_name: str, pool: NodePool | None = None, node: Node | None = None, **_: object
) -> str:
    where = f"pool:{pool.name}" if pool else f"node:{node.name}" if node else "nowhere"
    return f"{where}:{model_name}"


@audited("deployment.set", _deployment_target, (FleetError,))
def deployment_set(
    *,
    model_name: str,
    version: int,
    actor: Actor,
    pool: NodePool | None = None,
    node: Node | None = None,
    baseline: int | None = None,
    baseline_until: datetime | None = None,
    standby: int | None = None,
) -> Deployment:
    """Desire `model_name` at `version` on a pool (every node) or on one node, with `baseline`
    kept READY beside it when given (until `baseline_until`, when given), and the steps of
    pipeline release `standby` loaded beside it, unserved; idempotent."""
    if (pool is None) == (node is None):
        raise FleetError("a deployment targets a pool or a node")
    authorize(actor, "fleet.operate_node", pool or node.pool)  # type: ignore[union-attr]
    target = {"pool": pool.name} if pool else {"node": node.name}  # type: ignore[union-attr]
    second_person(
        actor,
        pool or node.pool,  # type: ignore[union-attr]
        "deployment.set",
        {**target, "model": model_name, "version": version, "baseline": baseline}
        | ({"standby": standby} if standby else {}),
    )
    found = (
        ModelVersion.objects.filter(model__name=model_name, version=version)
        .select_related("model")
        .first()
    )
    if found is None:
        raise FleetError(f"{model_name} v{version} is not in the registry")
    if MOVING_BACK.get():
        # Back to what served before, whatever its status since (deprecating the release
        # before a good one is routine): only files the nodes can no longer load refuse it.
        if gone := found.files_gone():
            raise FleetError(f"cannot move back: {gone}")
    elif found.status != ModelVersion.Status.PUBLISHED:
        raise FleetError(
            f"{model_name} v{version} is {found.status}; only published versions deploy"
        )
    if pool is not None and isinstance(actor, User) and not MOVING_BACK.get():
        # What a whole pool runs is a release manager's to change; on-call moves it back only.
        authorize(actor, "rollouts.add_rollout", pool)
        if (held := owner_holding(pool, found.model)) is not None:
            raise FleetError(held.why)  # a rollout's or a pin's until it ends
    existing = (
        Deployment.objects.select_for_update()
        .filter(model=found.model, pool=pool, node=node)
        .first()
    )
    for other in (baseline, standby):
        if other is not None and not found.model.versions.filter(version=other).exists():
            raise FleetError(f"{model_name} v{other} is not in the registry")
    if standby is not None and found.model.kind != Model.Kind.ENSEMBLE:
        raise FleetError(f"{model_name} is not a pipeline: only a pipeline's steps stand by")
    wants = (version, baseline, standby)
    same = (
        existing
        and (existing.version, existing.baseline_version, existing.standby_version) == wants
    )
    if existing is not None and same:
        return existing  # a double click changes nothing
    before = _versions(existing) if existing else {}
    if pool is not None and (existing is None or existing.version != version):
        _release_record(pool=pool, model=found.model, version=version, actor=actor)
    deployment, _ = Deployment.objects.update_or_create(
        model=found.model,
        pool=pool,
        node=node,
        defaults={
            "version": version,
            "baseline_version": baseline,
            "baseline_until": baseline_until if baseline else None,
            "standby_version": standby,
            "created_by": actor_name(actor),
            "request_id": REQUEST_ID.get(),
        },
    )
    audit_record(
        actor=actor,
        target=f"{deployment.target}:{model_name}",
        before=before,
        after=_versions(deployment),
    )
    reconcile_later(target_nodes(pool, node))
    return deployment


def _removed_target(*, deployment_id: int, **_: object) -> str:
    found = Deployment.objects.filter(pk=deployment_id).select_related("model", "pool", "node")
    return next((f"{d.target}:{d.model.name}" for d in found), f"deployment:{deployment_id}")


@audited("deployment.remove", _removed_target, (FleetError,))
def deployment_remove(*, deployment_id: int, actor: Actor) -> None:
    deployment = (
        Deployment.objects.select_for_update(of=("self",))  # pool and node are outer joins
        .select_related("model", "pool", "node__pool")
        .filter(pk=deployment_id)
        .first()
    )
    if deployment is None:
        raise FleetError(f"deployment {deployment_id} does not exist (removed already?)")
    where = deployment.pool or deployment.node.pool  # type: ignore[union-attr]
    authorize(actor, "fleet.operate_node", where)
    second_person(actor, where, "deployment.remove", {"deployment_id": deployment_id})
    nodes = target_nodes(deployment.pool, deployment.node)
    audit_record(
        actor=actor,
        target=f"{deployment.target}:{deployment.model.name}",
        before=_versions(deployment),
    )
    if deployment.pool is not None:
        _release_record(pool=deployment.pool, model=deployment.model, version=None, actor=actor)
    deployment.delete()
    reconcile_later(nodes)


def _release_record(*, pool: NodePool, model: Model, version: int | None, actor: Actor) -> None:
    """End the pool's current release of `model` and, unless it is being removed, start one."""
    now = timezone.now()
    Release.objects.filter(pool=pool, model=model, ended_at__isnull=True).update(ended_at=now)
    if version is not None:
        Release.objects.create(
            pool=pool, model=model, version=version, started_at=now, started_by=actor_name(actor)
        )


def _versions(deployment: Deployment) -> dict[str, int]:
    found = {"version": deployment.version}
    if deployment.baseline_version:
        found["baseline"] = deployment.baseline_version
    if deployment.standby_version:
        found["standby"] = deployment.standby_version
    return found


def target_nodes(pool: NodePool | None, node: Node | None) -> list[int]:
    if node is not None:
        return [node.pk]
    assert pool is not None
    return list(pool.nodes.values_list("id", flat=True))
