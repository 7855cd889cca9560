"""A rollout's steps: the step's canary nodes given the canary and their share of requests, the
wait until they are read back serving it (paused where a load failed or took too long), and
whether the step is done."""

from datetime import datetime

from apps.fleet import selectors
from apps.fleet.models import Node, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.traffic.balancer import share_weights, weights_set
from apps.rollouts.evidence import filling
from apps.rollouts.gate import gate_pending
from apps.rollouts.members import Scope
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Analysis, Step
from apps.rollouts.transitions import ACTOR, State, last_round_details, pause, transition
from apps.rollouts.verdicts import Verdict


def step_begin(rollout: Rollout, where: Scope, now: datetime) -> None:
    """The step's share goes out; its rounds and its synthetic requests start afresh."""
    apply_share(rollout, where)
    rollout.step_started_at, rollout.step_ready_at = now, None
    rollout.synthetic_load = None  # each step makes requests only where it lacks them
    rollout.last_verdict, rollout.last_measured_at = "", None
    transition(rollout, State.PROGRESSING, event="step")


def apply_share(rollout: Rollout, where: Scope) -> None:
    """The step's canary nodes get the canary; on a pool whose balancer weighs nodes, they get
    the step's exact share of requests (the nodes loading it are drained meanwhile)."""
    step, canary, nodes = where.step, where.canary, where.nodes
    rollout.canary_nodes = [node.name for node in canary]
    if rollout.pool.traffic:
        each, rest = share_weights(step.percent or 100, len(canary), len(nodes))
        if step.percent is None:  # a step in nodes: as many requests as any other node
            each = rest
        if gate_pending(rollout):  # no request reaches the canary before its answers are right
            each = 0
        weights = {node.name: each if node in canary else rest for node in nodes}
        weights_set(rollout.pool, weights, ACTOR)
    for member in where.released:
        for node in canary:
            deployment_set(
                model_name=member.model.name,
                version=member.canary,
                baseline=member.beside,
                node=node,
                actor=ACTOR,
            )


def canary_ready(rollout: Rollout, where: Scope, spec: Analysis, now: datetime) -> bool:
    """Whether every canary node is read back serving what the step released to it."""
    canary, released = where.canary, where.released
    wanted = {m.model.name: m.versions for m in released}
    readings = selectors.observed_many(canary, list(wanted))
    waiting = [
        n for n in canary if any(readings[(n.pk, name)][0] != v for name, v in wanted.items())
    ]
    if not waiting:
        return True
    what = ", ".join(f"{m.model.name} v{m.canary}" for m in released)
    stalled(rollout, waiting, list(wanted), what, spec, now)
    return False


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


def step_done(rollout: Rollout, step: Step, spec: Analysis, now: datetime) -> bool:
    """Whether the step is done: held for its time, its last round letting it go on (a dry run
    goes on whatever it found). An inconclusive round waits while synthetic requests fill the
    judge's window, and pauses otherwise: a step never goes on on too little evidence."""
    assert rollout.step_ready_at is not None
    if (now - rollout.step_ready_at).total_seconds() < step.hold_s:
        return False
    stopped = ("",) if spec.dry_run else ("", Verdict.FAILURE, Verdict.ERROR)
    if rollout.last_verdict in stopped:
        return False
    if rollout.last_verdict == Verdict.INCONCLUSIVE and not spec.dry_run:
        if not filling(rollout, spec, now):
            pause(rollout, f"inconclusive: {last_round_details(rollout)}")
        return False
    return True
