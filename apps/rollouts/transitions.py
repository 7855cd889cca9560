"""What a rollout releases and the changes its controller makes: its members, its state's
transitions (each audited, with a webhook message), the move back of its canary nodes, and
what its nodes are read back serving."""

from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from apps.accounts.permissions import moving_back
from apps.audit.services import Actor, actor_name, audit_record
from apps.fleet import selectors
from apps.fleet.models import Deployment, Node, NodePool, Operation, PoolOwner
from apps.fleet.owners import owner_claim, owner_let_go
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.traffic.balancer import weights_set
from apps.registry.codec import from_dict
from apps.registry.ensembles import UnresolvedStep, pinned_steps
from apps.registry.models import Model
from apps.registry.selectors import registry_resolver
from apps.rollouts.analysis import ChangedStep, Result
from apps.rollouts.gates import (
    ACTOR,
)
from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.notify import notify
from apps.rollouts.plans import Analysis

State = Rollout.State


def pool_nodes(rollout: Rollout) -> list[Node]:
    """The pool's serving nodes: one joining, quarantined or departed is no rollout's (it gets
    the pool's release when it joins)."""
    return list(rollout.pool.nodes.serving().order_by("name"))


@dataclass(frozen=True)
class Member:
    """One model a rollout releases: its own, or one released in lockstep with it."""

    model: Model
    baseline: int
    canary: int

    @property
    def beside(self) -> int | None:
        """The baseline kept READY beside the canary, so that rolling back only narrows the
        version policy; none when the canary's number is lower, since an unversioned request
        goes to the highest READY version."""
        return self.baseline if self.canary > self.baseline else None

    @property
    def versions(self) -> set[int]:
        """What a canary node serves."""
        return {self.canary} | ({self.beside} if self.beside else set())


def members(rollout: Rollout) -> list[Member]:
    """The models a rollout releases, in dependency order: plain models before the pipelines
    that may pin them. They go to the same nodes, are judged together and promote or roll back
    as one."""
    lead = Member(rollout.model, rollout.baseline_version, rollout.canary_version)
    if not rollout.lockstep:
        return [lead]
    models = Model.objects.in_bulk([m["model"] for m in rollout.lockstep], field_name="name")
    found = [
        lead,
        *(Member(models[m["model"]], m["baseline"], m["canary"]) for m in rollout.lockstep),
    ]
    return sorted(found, key=lambda m: m.model.kind == Model.Kind.ENSEMBLE)


def transition(
    rollout: Rollout, state: str, reason: str = "", event: str = "", actor: Actor = ACTOR
) -> None:
    """Save the new state, with one audit event and a webhook message."""
    before = rollout.state
    rollout.state = state
    rollout.reason = reason or rollout.reason
    if state in Rollout.TERMINAL:
        rollout.finished_at = timezone.now()
        for member in members(rollout):  # the pool's release is the reconciler's again
            owner_let_go(pool=rollout.pool, model=member.model, ref=owner_ref(rollout))
    rollout.save()
    audit_record(
        actor=actor,
        action=f"rollout.{event or state}",
        target=f"rollout:{rollout.pk}:{rollout.model.name}",
        before={"state": before, "step": rollout.step},
        after={
            "state": state,
            "step": rollout.step,
            "version": rollout.canary_version,
            "pool": rollout.pool.name,  # its target names the rollout and the model, not the pool
        },
        result="failed" if state == State.FAILED else "ok",
        message=reason,
    )
    notify(rollout, event or state)


def owner_ref(rollout: Rollout) -> str:
    """How a rollout names itself as the owner of what its pool serves (fleet.PoolOwner)."""
    return f"rollout:{rollout.pk}"


def pool_claim(rollout: Rollout, by: str) -> PoolOwner | None:
    """The rollout owns what its pool serves of each model it releases, until it ends; returns
    the owner that holds one of them instead (on-call's pin on a degradation tier)."""
    why = (
        f"rollout #{rollout.pk} of {rollout.moves} on {rollout.pool.name} holds it: abort it, "
        "or roll the pool back, before changing the release by hand"
    )
    for member in members(rollout):
        if held := owner_claim(
            pool=rollout.pool,
            model=member.model,
            kind=PoolOwner.Kind.ROLLOUT,
            ref=owner_ref(rollout),
            why=why,
            by=by,
        ):
            return held
    return None


def pause(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    transition(rollout, State.PAUSED, reason, actor=actor)


def roll_back(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    """The rollout rolled back: by itself (the controller's verdict, a failed gate or switch), or
    as a person's abort asks. Canary nodes back to the pool's deployment, the baseline, which
    they still serve: only a narrowing. During a promotion the pool itself goes back to the
    baseline. On a pool whose balancer weighs nodes, the canary nodes first get no traffic
    (where others can take it) until the rollback is read back everywhere. A move back: never
    held for a second person on a protected pool."""
    # No request reaches the canary from now on, where other nodes can take them: a canary on
    # every node (a blue-green release's too) narrows in traffic instead.
    others = rollout.pool.nodes.exclude(name__in=rollout.canary_nodes).exists()
    if rollout.pool.traffic and others:
        weights_set(rollout.pool, dict.fromkeys(rollout.canary_nodes, 0), actor_name(actor))
    released = members(rollout)
    pooled = pool_deployments(rollout, released)
    with moving_back():
        for member in reversed(released):  # pipelines first, then what they pin
            pool = pooled.get(member.model.name)
            if pool is not None and (pool.version == member.canary or pool.standby_version):
                # A blue-green release not switched yet: its standby goes, the rest stays.
                kept = pool.version != member.canary
                deployment_set(
                    model_name=member.model.name,
                    version=member.baseline,
                    pool=rollout.pool,
                    actor=actor,
                    baseline=pool.baseline_version if kept else None,
                    baseline_until=pool.baseline_until if kept else None,
                )
            drop_node_deployments(member.model, rollout.pool, actor)
    transition(rollout, State.ABORTING, reason, actor=actor)


def drop_node_deployments(model: Model, pool: NodePool, actor: Actor) -> None:
    """Every node of the pool back to the pool's own deployment of `model`."""
    for deployment in Deployment.objects.filter(model=model, node__pool=pool):
        deployment_remove(deployment_id=deployment.pk, actor=actor)


def stalled(
    rollout: Rollout,
    waiting: list[Node],
    models: list[str],
    what: str,
    spec: Analysis,
    now: datetime,
) -> None:
    """Pause a rollout whose nodes do not get to READY: a load of `models` failed, or they
    took longer than the analysis allows."""
    failed = (
        waiting[0]
        .operations.filter(model_name__in=models, finished_at__gte=rollout.step_started_at)
        .exclude(status__in=["succeeded", "cancelled", *Operation.OPEN])
        .first()
    )
    if failed is not None:
        return pause(rollout, f"{waiting[0].name}: {failed.kind} failed: {failed.error}")
    assert rollout.step_started_at is not None
    if (now - rollout.step_started_at).total_seconds() > spec.converge_timeout_s:
        names = ", ".join(n.name for n in waiting)
        return pause(rollout, f"{what} not READY on {names} after {spec.converge_timeout_s} s")
    return None


def record(
    rollout: Rollout, results: list[Result], verdict: str, kind: str = Round.Kind.ANALYSIS
) -> Round:
    """A round of the rollout's step, with its verdict, and its measurements."""
    number = rollout.rounds.filter(step=rollout.step).count() + 1
    judged = Round.objects.create(
        rollout=rollout, step=rollout.step, number=number, kind=kind, verdict=verdict
    )
    Measurement.objects.bulk_create(
        Measurement(
            rollout=rollout,
            round=judged,
            step=rollout.step,
            metric=r.metric,
            query=r.query,
            canary_value=r.canary,
            baseline_value=r.baseline,
            threshold=r.threshold,
            verdict=r.verdict,
            detail=r.detail,
            evidence=r.evidence,
        )
        for r in results
    )
    return judged


def changed_steps(member: Member) -> list[ChangedStep]:
    """The steps an ensemble release pins at another version than its baseline does."""
    configs = dict(
        member.model.versions.filter(version__in=[member.baseline, member.canary]).values_list(
            "version", "config"
        )
    )
    resolve = registry_resolver()

    def pins(version: int) -> dict[str, int]:
        if version not in configs:
            return {}
        try:
            steps = pinned_steps(from_dict(configs[version]), resolve)
        except UnresolvedStep:  # no longer loadable: nothing to compare
            return {}
        return {name: number for name, number in steps}

    canary, baseline = pins(member.canary), pins(member.baseline)
    budgets = dict(Model.objects.filter(name__in=canary).values_list("name", "latency_budget_ms"))
    return [
        ChangedStep(name, version, before, budgets.get(name))
        for name, version in sorted(canary.items())
        if (before := baseline.get(name)) is not None and before != version
    ]


def serves(deployment: Deployment) -> set[int]:
    """The versions a deployment keeps READY: its own, and the one kept beside it."""
    return {v for v in (deployment.version, deployment.baseline_version) if v}


def pool_deployments(rollout: Rollout, released: list[Member]) -> dict[str, Deployment]:
    """The pool's own deployments of the models the rollout releases, by model name."""
    found = Deployment.objects.filter(model__in=[m.model for m in released], pool=rollout.pool)
    return {d.model.name: d for d in found.select_related("model")}


def all_serve(
    rollout: Rollout, versions: dict[str, set[int]], timed: list[str] | None = None
) -> datetime | None:
    """None while a node of the pool is not read back serving exactly each model's `versions`;
    then since when all of them (or all `timed` nodes) do."""
    nodes = pool_nodes(rollout)
    found = selectors.observed_many(nodes, list(versions))
    if not nodes or any(
        found[(n.pk, name)][0] != wanted for n in nodes for name, wanted in versions.items()
    ):
        return None
    since = [
        found[(n.pk, name)][1] for n in nodes if not timed or n.name in timed for name in versions
    ]
    return max((at for at in since if at is not None), default=timezone.now())
