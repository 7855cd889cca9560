import re
from collections.abc import Callable
from datetime import datetime
from urllib.parse import urlsplit

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.accounts.models import PoolRole
from apps.accounts.permissions import MOVING_BACK, authorize, second_person
from apps.accounts.services import RoleError, user_role
from apps.audit.context import REQUEST_ID
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet import addresses, failures
from apps.fleet.desired import node_desired
from apps.fleet.models import Deployment, Node, NodePool, Operation, Release
from apps.fleet.tasks import enqueue_run, reconcile_node, send_per_node
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.traffic.haproxy import HAProxyError, Runtime, name_refusal
from apps.registry.models import Model, ModelVersion


class FleetError(Exception):
    """A refused fleet change; the message says why and what to do instead."""


def validate_node_url(url: str, *, field: str) -> None:
    """http(s) with a host and a port, and no credentials: they would end up in logs and pages;
    at an address the control plane may contact (apps.fleet.addresses)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise FleetError(f"{field} {url!r}: the port is not a number from 1 to 65535") from None
    if parts.scheme not in ("http", "https", "grpc"):
        raise FleetError(f"{field} {url!r}: use http:// or https://")
    if parts.username or parts.password:
        raise FleetError(f"{field} {url!r}: no credentials in node addresses")
    if not parts.hostname:
        raise FleetError(f"{field} {url!r}: a host is required")
    if port is None and parts.scheme == "grpc":
        raise FleetError(f"{field} {url!r}: host:port is required")
    refused = addresses.refusal(parts.hostname)
    if refused:
        raise FleetError(f"{field} {url!r}: {refused}")


@audited("node.register", lambda name, **_: f"node:{name}", (FleetError,))
def node_register(
    *, name: str, pool: str, http_url: str, grpc_url: str, metrics_url: str, actor: str
) -> Node:
    """Create or update a node by name; re-registering with the same addresses changes nothing."""
    if refused := name_refusal(name, what="node name"):  # it names the node's balancer server
        raise FleetError(refused)
    for field, url in (("http_url", http_url), ("metrics_url", metrics_url)):
        if url or field == "http_url":
            validate_node_url(url, field=field)
    if grpc_url:
        validate_node_url(f"grpc://{grpc_url}", field="grpc_url")
    node_pool, _ = NodePool.objects.get_or_create(name=pool)
    wanted = {"pool": node_pool, "http_url": http_url, "grpc_url": grpc_url}
    wanted["metrics_url"] = metrics_url
    node = Node.objects.select_for_update().filter(name=name).first()
    before = {} if node is None else {k: str(getattr(node, k)) for k in wanted}
    after = {k: str(v) for k, v in wanted.items()}
    if node is None:
        node = Node.objects.create(name=name, **wanted)
    elif before != after:
        for key, value in wanted.items():
            setattr(node, key, value)
        node.save(update_fields=list(wanted))
    if before != after:
        audit_record(
            actor=actor, action="node.register", target=f"node:{name}", before=before, after=after
        )
    return node


# Who else decides what a pool runs of a model, asked before a person's pool-wide change: each
# says why that change must wait ("" when it need not). Apps above the fleet register theirs (a
# rollout under way: apps.rollouts.apps), so that one owner decides at a time.
POOL_OWNERS: list[Callable[[NodePool, Model], str]] = []


def _reconcile_later(node_ids: list[int]) -> None:
    # Robust: with the broker away the change is committed all the same (never a 500), and the
    # periodic reconcile carries it out.
    transaction.on_commit(lambda: send_per_node(reconcile_node, node_ids), robust=True)


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
    if found.status != ModelVersion.Status.RELEASED:
        raise FleetError(
            f"{model_name} v{version} is {found.status}; only released versions deploy"
        )
    if pool is not None and isinstance(actor, User) and not MOVING_BACK.get():
        # What a whole pool runs is a release manager's to change; on-call moves it back only.
        authorize(actor, "rollouts.add_rollout", pool)
        for owner in POOL_OWNERS:
            if busy := owner(pool, found.model):
                raise FleetError(busy)
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
        _release_switch(pool=pool, model=found.model, version=version, actor=actor)
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
        action="deployment.set",
        target=f"{deployment.target}:{model_name}",
        before=before,
        after=_versions(deployment),
    )
    _reconcile_later(_target_nodes(pool, node))
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
    nodes = _target_nodes(deployment.pool, deployment.node)
    audit_record(
        actor=actor,
        action="deployment.remove",
        target=f"{deployment.target}:{deployment.model.name}",
        before=_versions(deployment),
    )
    if deployment.pool is not None:
        _release_switch(pool=deployment.pool, model=deployment.model, version=None, actor=actor)
    deployment.delete()
    _reconcile_later(nodes)


def _node_target(*, node_id: int, model_name: str, **_: object) -> str:
    name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
    return f"node:{name}:{model_name}"


@audited(lambda kind, **_: f"operation.request_{kind}", _node_target, (FleetError,))
def operation_request(*, node_id: int, kind: str, model_name: str, actor: Actor) -> Operation:
    """A person's reload or unload on one node. A second click while one is open returns it."""
    node = Node.objects.select_for_update().select_related("pool").get(pk=node_id)
    authorize(actor, "fleet.operate_node", node.pool)
    open_op = node.operations.filter(
        model_name=model_name,
        kind=kind,
        status__in=Operation.OPEN,
    ).first()
    if open_op is not None:
        return open_op
    desired = node_desired(node).get(model_name)
    if kind == Operation.Kind.UNLOAD and desired is not None:
        raise FleetError(
            f"{model_name} is deployed to {node.name} (pool {node.pool.name}); change or remove "
            "the deployment instead, or the reconciler would load it again"
        )
    if kind == Operation.Kind.UNLOAD and model_name not in node.owned:
        raise FleetError(
            f"{model_name} on {node.name} was loaded by someone else, so the control plane does "
            "not manage it; adopt it first to unload it from here"
        )
    if kind == Operation.Kind.RELOAD and desired is None:
        raise FleetError(f"{model_name} is not deployed to {node.name}; deploy it to load it")
    op = Operation.objects.create(
        node=node,
        kind=kind,
        model_name=model_name,
        versions=list(desired.versions) if desired else [],
        config=desired.config if desired else None,
        config_digest=desired.digest if desired else "",
        requested_by=actor_name(actor),
    )
    audit_record(
        actor=actor, action=f"operation.request_{kind}", target=f"node:{node.name}:{model_name}"
    )
    transaction.on_commit(lambda: enqueue_run(node_id), robust=True)
    return op


@audited("operation.override", lambda operation_id, **_: f"operation:{operation_id}", (FleetError,))
def operation_override(*, operation_id: int, reason: str, actor: Actor) -> Operation:
    """Send a load the memory preflight refused, as it was planned, because a person says the
    node has the room (say, a footprint measured while something else loaded)."""
    refused = (
        Operation.objects.select_related("node__pool")
        .filter(pk=operation_id, failure=failures.MEMORY)
        .first()
    )
    if refused is None:
        raise FleetError(f"operation #{operation_id} was not refused for want of memory")
    authorize(actor, "fleet.operate_node", refused.node.pool)
    reason = reason.strip()
    if not reason:
        raise FleetError("an override needs a reason, for the audit trail")
    params = {"operation_id": operation_id, "reason": reason, "node": refused.node.name}
    second_person(actor, refused.node.pool, "operation.override", params)
    op = Operation.objects.create(
        node=refused.node,
        kind=refused.kind,
        model_name=refused.model_name,
        versions=refused.versions,
        config=refused.config,
        config_digest=refused.config_digest,
        requested_by=actor_name(actor),
        override=reason,
    )
    audit_record(
        actor=actor,
        action="operation.override",
        target=f"node:{refused.node.name}:{refused.model_name}",
        after={"refused": operation_id, "operation": op.pk, "versions": op.versions},
        message=reason,
    )
    transaction.on_commit(lambda: enqueue_run(refused.node_id), robust=True)
    return op


def _release_switch(*, pool: NodePool, model: Model, version: int | None, actor: Actor) -> None:
    """End the pool's current release of `model` and, unless it is being removed, start one."""
    now = timezone.now()
    Release.objects.filter(pool=pool, model=model, ended_at__isnull=True).update(ended_at=now)
    if version is not None:
        Release.objects.create(
            pool=pool, model=model, version=version, started_at=now, started_by=actor_name(actor)
        )


@audited("node.adopt", _node_target, (FleetError,))
def node_adopt(*, node_id: int, model_name: str, actor: Actor) -> Node:
    """Take over a model someone else loaded on the node: from now on the reconciler manages it,
    so it is unloaded unless a deployment names it."""
    node = Node.objects.select_for_update().select_related("pool").get(pk=node_id)
    authorize(actor, "fleet.operate_node", node.pool)
    # Adopted, a model is unloaded unless a deployment names it: a change to what the pool runs.
    second_person(actor, node.pool, "node.adopt", {"node": node.name, "model": model_name})
    if model_name in node.owned:
        raise FleetError(f"{model_name} on {node.name} is managed already")
    if not any(entry["model"] == model_name for entry in node.index):
        raise FleetError(f"{model_name} is not on {node.name} (by its last repository index)")
    node.owned = sorted({*node.owned, model_name})
    node.save(update_fields=["owned"])
    audit_record(
        actor=actor,
        action="node.adopt",
        target=f"node:{node.name}:{model_name}",
        after={"managed": True},
        message="the reconciler unloads it unless a deployment names it",
    )
    return node


QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,59}")


@audited("pool.set_queue", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_queue(*, pool_name: str, queue: str, actor: Actor) -> NodePool:
    """Route the pool's node work (polls, reconciles, loads) to `queue`; empty: the default."""
    if queue and not QUEUE_NAME.fullmatch(queue):
        raise FleetError(f"queue {queue!r}: letters, digits, '_', '.' and '-', at most 60")
    return _pool_set(pool_name, "pool.set_queue", {"queue": queue}, actor)


@audited("pool.set_protected", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_protected(*, pool_name: str, protected: bool, actor: Actor) -> NodePool:
    """A protected pool's deployments, promotions and rollbacks need two people."""
    return _pool_set(pool_name, "pool.set_protected", {"protected": protected}, actor)


@audited("node.set_memory", lambda node_name, **_: f"node:{node_name}", (FleetError,))
def node_set_memory(*, node_name: str, limit_mb: int | None, actor: Actor) -> Node:
    """The memory models may take on the node (None: no limit). Set, every load there is
    checked against it first and its footprint measured (apps/fleet/memory.py)."""
    node = Node.objects.select_for_update().filter(name=node_name).first()
    if node is None:
        raise FleetError(f"no node {node_name!r}")
    if limit_mb is not None and limit_mb < 1:
        raise FleetError(f"node {node_name}: a memory limit of {limit_mb} MiB is not one")
    if node.memory_limit_mb != limit_mb:
        audit_record(
            actor=actor,
            action="node.set_memory",
            target=f"node:{node_name}",
            before={"memory_limit_mb": node.memory_limit_mb},
            after={"memory_limit_mb": limit_mb},
        )
        node.memory_limit_mb = limit_mb
        node.save(update_fields=["memory_limit_mb"])
    return node


@audited("pool.set_rollback_window", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_rollback_window(*, pool_name: str, seconds: int, actor: Actor) -> NodePool:
    """How long, after a promotion, the release before stays loaded beside the new one (0:
    not at all): a rollback inside the window only narrows the version policy."""
    if seconds < 0:
        raise FleetError(f"pool {pool_name}: a rollback window of {seconds} s is not one")
    return _pool_set(pool_name, "pool.set_rollback_window", {"rollback_window_s": seconds}, actor)


BACKEND_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


@audited("pool.set_traffic", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_traffic(
    *,
    pool_name: str,
    traffic: str,
    actor: Actor,
    runtime: str = "",
    backends: list[str] | None = None,
    min_serving: int = 1,
    warmup_requests: int = 5,
    drain_timeout_s: int = 30,
) -> NodePool:
    """Put the pool behind a balancer (`haproxy`: its runtime API at `runtime`, the pool's nodes
    servers of `backends`), or back to shares by node count (""). The balancer is asked for its
    backends first: a setting it cannot carry out is refused, and the weights go out at once."""
    backends = backends or []
    if traffic not in NodePool.Traffic.values:
        raise FleetError(
            f"traffic {traffic!r}: one of {', '.join(map(repr, NodePool.Traffic.values))}"
        )
    if traffic:
        bad = next((name for name in backends if not BACKEND_NAME.fullmatch(name)), None)
        if not backends or bad is not None:
            raise FleetError(
                f"backends: name the HAProxy backends of the pool's nodes, not {bad!r}"
            )
        try:
            for backend in backends:
                Runtime(runtime).weights(backend)
        except HAProxyError as exc:
            raise FleetError(str(exc)) from None
    if not (
        0 <= min_serving <= 1000 and 0 <= warmup_requests <= 1000 and 1 <= drain_timeout_s <= 3600
    ):
        raise FleetError("min_serving and warmup_requests: 0-1000; drain_timeout_s: 1-3600")
    settings = {
        "traffic": traffic,
        "traffic_runtime": runtime if traffic else "",
        "traffic_backends": ",".join(backends) if traffic else "",
        "min_serving": min_serving,
        "warmup_requests": warmup_requests,
        "drain_timeout_s": drain_timeout_s,
    }
    pool = _pool_set(pool_name, "pool.set_traffic", settings, actor)
    # Once committed: the balancer is never asked while the pool's row is held.
    transaction.on_commit(lambda: traffic_sync(pool.pk), robust=True)
    return pool


def _pool_set(pool_name: str, action: str, values: dict[str, object], actor: Actor) -> NodePool:
    """Settings of a pool, audited as one `action` when any of them changes."""
    pool = NodePool.objects.select_for_update().filter(name=pool_name).first()
    if pool is None:
        raise FleetError(f"no pool {pool_name!r}")
    changed = {name: value for name, value in values.items() if getattr(pool, name) != value}
    if changed:
        audit_record(
            actor=actor,
            action=action,
            target=f"pool:{pool_name}",
            before={name: getattr(pool, name) for name in changed},
            after=changed,
        )
        for name, value in changed.items():
            setattr(pool, name, value)
        pool.save(update_fields=list(changed))
    return pool


def _versions(deployment: Deployment) -> dict[str, int]:
    found = {"version": deployment.version}
    if deployment.baseline_version:
        found["baseline"] = deployment.baseline_version
    if deployment.standby_version:
        found["standby"] = deployment.standby_version
    return found


def _target_nodes(pool: NodePool | None, node: Node | None) -> list[int]:
    if node is not None:
        return [node.pk]
    assert pool is not None
    return list(pool.nodes.values_list("id", flat=True))


@audited("user.pool_role_set", lambda username, **_: f"user:{username}", (RoleError,))
def pool_role_set(*, username: str, pool_name: str, role: str, actor: User | str) -> None:
    """Give `username` `role` (operator or release_manager) on one pool, or none ("")."""
    user = User.objects.filter(username=username).first()
    pool = NodePool.objects.filter(name=pool_name).first()
    if user is None:
        raise RoleError(f"no user named {username!r}")
    if pool is None:
        raise RoleError(f"no pool named {pool_name!r}")
    if role and role not in PoolRole.Role.values:
        raise RoleError(f"a pool role is one of {', '.join(PoolRole.Role.values)}, not {role!r}")
    if user_role(user) is None:
        raise RoleError(f"{username} has no role: give them one (viewer at least) first")
    held = PoolRole.objects.filter(user=user, pool=pool).values_list("role", flat=True).first()
    if (held or "") == role:
        return
    if role:
        PoolRole.objects.update_or_create(user=user, pool=pool, defaults={"role": role})
    else:
        PoolRole.objects.filter(user=user, pool=pool).delete()
    audit_record(
        actor=actor,
        action="user.pool_role_set",
        target=f"user:{username}",
        before={"pool": pool_name, "role": held or ""},
        after={"pool": pool_name, "role": role},
    )
