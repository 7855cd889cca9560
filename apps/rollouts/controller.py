"""The rollout state machine, advanced by a periodic task. One tick takes the rollout's row lock,
does at most one transition and saves it; everything it needs is in the database, so any process
may be killed at any point and the next tick carries on without repeating a step.

    pending -> progressing (step i) <-> paused -> promoting -> succeeded
    (any active state) -> aborting -> rolled_back;  failed when the fleet cannot do what it must.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from apps.fleet import selectors
from apps.fleet.models import Node
from apps.fleet.services.deployments import deployment_set
from apps.fleet.traffic.balancer import share_weights, weights_set
from apps.prometheus.client import PrometheusUnavailable
from apps.quality.errors import QualityError
from apps.rollouts.analysis import Result, measure, overall
from apps.rollouts.bluegreen import blue_green
from apps.rollouts.gates import (
    ACTOR,
    drive_evidence,
    evaluate,
    evaluated,
    evaluation_verdict,
    filling,
    gate_deadline,
    labelled,
)
from apps.rollouts.models import Rollout, Round
from apps.rollouts.plans import Analysis, canary_nodes, parse_plan
from apps.rollouts.promotion import aborting, promote
from apps.rollouts.slo import Objectives
from apps.rollouts.transitions import (
    State,
    changed_steps,
    members,
    pause,
    pool_nodes,
    record,
    roll_back,
    stalled,
    transition,
)
from apps.rollouts.verdicts import Verdict

log = logging.getLogger(__name__)

TICK_ERROR_LIMIT = 3


def rollout_advance(*, rollout_id: int) -> None:
    try:
        # Prometheus may take its whole timeout to answer: measured before the row lock, so a
        # person's pause or abort never waits behind it; used only if nothing moved meanwhile.
        reading = _measure_ahead(rollout_id)
        with transaction.atomic():
            rollout = (
                Rollout.objects.select_for_update()
                .select_related("model", "pool")
                .get(pk=rollout_id)
            )
            handler = HANDLERS.get(rollout.state)
            if handler is not None:
                handler(rollout, reading)
            if rollout.tick_errors:
                Rollout.objects.filter(pk=rollout_id).update(tick_errors=0, tick_error="")
    except Exception as exc:  # a bug, or the database away: a rollout must not stall unseen
        _tick_failed(rollout_id, exc)
        raise


def _tick_failed(rollout_id: int, exc: Exception) -> None:
    """Record the failure on the rollout, for its page; after TICK_ERROR_LIMIT in a row a rollout
    still moving forward pauses, so that a person looks. One aborting or promoting keeps trying:
    stopping half-way would be worse."""
    log.exception("rollout #%s: tick failed", rollout_id)
    try:
        with transaction.atomic():
            rollout = Rollout.objects.select_for_update().select_related("model").get(pk=rollout_id)
            rollout.tick_errors += 1
            rollout.tick_error = f"{type(exc).__name__}: {exc}"[:2000]
            rollout.save(update_fields=["tick_errors", "tick_error", "updated_at"])
            forward = rollout.state in (State.PENDING, State.PROGRESSING)
            if forward and rollout.tick_errors >= TICK_ERROR_LIMIT:
                why = f"the controller failed {rollout.tick_errors} ticks in a row"
                why += f" ({rollout.tick_error})"
                pause(rollout, f"{why}; resume once it is fixed")
    except Exception:  # the database itself may be what failed: the log has it
        log.exception("rollout #%s: could not record the failed tick", rollout_id)


def _canary(rollout: Rollout, nodes: list[Node]) -> list[Node]:
    step = parse_plan(rollout.plan)[rollout.step]
    names = set(canary_nodes(step, [n.name for n in nodes]))
    return [n for n in nodes if n.name in names]


@dataclass(frozen=True)
class Measured:
    """An analysis round measured before the rollout's lock was taken, of the rollout as it was
    then (`of`, as `_as_measured` says)."""

    of: tuple[object, ...]
    results: list[Result] = field(default_factory=list)
    error: PrometheusUnavailable | None = None


def _as_measured(rollout: Rollout, compare: bool) -> tuple[object, ...]:
    """What a measurement was taken for: a reading of another step, canary or round is stale."""
    return (
        rollout.state,
        rollout.step,
        rollout.step_started_at,
        rollout.step_ready_at,
        rollout.last_measured_at,
        tuple(rollout.canary_nodes),
        compare,
    )


def _due(rollout: Rollout, spec: Analysis, now: datetime) -> bool:
    """Judged on whole windows of canary traffic, after the load's own spike has passed, every
    interval."""
    if rollout.step_ready_at is None:
        return False
    warm = (now - rollout.step_ready_at).total_seconds() >= spec.warmup_s + spec.window_s
    return warm and (
        rollout.last_measured_at is None
        or (now - rollout.last_measured_at).total_seconds() >= spec.interval_s
    )


def _measure_ahead(rollout_id: int) -> Measured | None:
    """The round a tick is about to judge, if one is due, read without any lock."""
    found = Rollout.objects.select_related("model", "pool").filter(pk=rollout_id).first()
    if found is None or found.state != State.PROGRESSING or found.step_started_at is None:
        return None
    if found.strategy == Rollout.Strategy.BLUE_GREEN:
        return None  # judged on its evaluations alone
    spec = Analysis.from_dict(found.analysis)
    if not _due(found, spec, timezone.now()):
        return None
    nodes = pool_nodes(found)
    compare = len(_canary(found, nodes)) < len(nodes)
    of = _as_measured(found, compare)
    try:
        return Measured(of, results=_measure(found, spec, compare))
    except PrometheusUnavailable as exc:
        return Measured(of, error=exc)


def _progress(rollout: Rollout, reading: Measured | None = None) -> None:
    if rollout.strategy == Rollout.Strategy.BLUE_GREEN:
        return blue_green(rollout)
    steps = parse_plan(rollout.plan)
    spec = Analysis.from_dict(rollout.analysis)
    nodes = pool_nodes(rollout)
    if not nodes:
        return pause(rollout, f"pool {rollout.pool.name} has no nodes")
    canary = _canary(rollout, nodes)
    now = timezone.now()
    if rollout.step_started_at is None:
        _apply_share(rollout, canary, nodes)
        rollout.step_started_at, rollout.step_ready_at = now, None
        rollout.synthetic_load = None  # each step makes requests only where it lacks them
        rollout.last_verdict, rollout.last_measured_at = "", None
        return transition(rollout, State.PROGRESSING, event="step")
    down = [n.name for n in nodes if n.health == Node.Health.UNREACHABLE]
    if down:
        return pause(rollout, f"node {', '.join(down)} is unreachable; resume when it is back")
    if rollout.step_ready_at is None:
        return _await_canary(rollout, canary, spec, now)
    compare = len(canary) < len(nodes)
    drive_evidence(rollout, spec, canary, nodes, now)
    if _due(rollout, spec, now):
        if reading is None or reading.of != _as_measured(rollout, compare):
            return None  # it moved since, or came due since: measured on the next tick
        _analyse(rollout, spec, reading)
        if rollout.state != State.PROGRESSING:
            return None
    held = (now - rollout.step_ready_at).total_seconds() >= steps[rollout.step].hold_s
    # A dry run measures and records its verdicts, and goes on whatever they are.
    stopped = ("",) if spec.dry_run else ("", Verdict.FAILURE, Verdict.ERROR)
    if not held or rollout.last_verdict in stopped:
        return None
    if rollout.last_verdict == Verdict.INCONCLUSIVE and not spec.dry_run:
        if filling(rollout, spec, now):
            return None  # the requests the judge needs are being made: it waits for them
        return pause(rollout, f"inconclusive: {_last_round_details(rollout)}")
    if rollout.step + 1 < len(steps):
        rollout.step += 1
        rollout.step_started_at = None
        rollout.save()
        return _progress(rollout)  # the next share goes out in this same tick
    return transition(rollout, State.PROMOTING)


def _last_round_details(rollout: Rollout) -> str:
    """What the last analysis round found, once per distinct finding."""
    found = rollout.measurements.filter(taken_at__gte=rollout.last_measured_at).exclude(
        verdict=Verdict.SUCCESS
    )
    details = dict.fromkeys(m.detail for m in found.order_by("taken_at", "id") if m.detail)
    return "; ".join(details) or "no data"


def _apply_share(rollout: Rollout, canary: list[Node], nodes: list[Node]) -> None:
    """The step's canary nodes get the canary; on a pool whose balancer weighs nodes, they get
    the step's exact share of requests (the nodes loading it are drained meanwhile)."""
    rollout.canary_nodes = [node.name for node in canary]
    if rollout.pool.traffic:
        step = parse_plan(rollout.plan)[rollout.step]
        each, rest = share_weights(step.percent or 100, len(canary), len(nodes))
        if step.percent is None:  # a step in nodes: as many requests as any other node
            each = rest
        if gate_pending(rollout):  # no request reaches the canary before its answers are right
            each = 0
        weights = {node.name: each if node in canary else rest for node in nodes}
        weights_set(rollout.pool, weights, ACTOR)
    for member in members(rollout):
        for node in canary:
            deployment_set(
                model_name=member.model.name,
                version=member.canary,
                baseline=member.beside,
                node=node,
                actor=ACTOR,
            )


def _await_canary(rollout: Rollout, canary: list[Node], spec: Analysis, now: datetime) -> None:
    released = members(rollout)
    wanted = {m.model.name: m.versions for m in released}
    readings = selectors.observed_many(canary, list(wanted))
    waiting = [
        n for n in canary if any(readings[(n.pk, name)][0] != v for name, v in wanted.items())
    ]
    if not waiting:
        if gate_pending(rollout):
            return _gate(rollout, canary, spec, now)
        rollout.step_ready_at = now
        rollout.save()
        return None
    what = ", ".join(f"{m.model.name} v{m.canary}" for m in released)
    return stalled(rollout, waiting, list(wanted), what, spec, now)


def gate_pending(rollout: Rollout) -> bool:
    """Whether the canary still has its quality gate to pass before any traffic."""
    spec = Analysis.from_dict(rollout.analysis)
    return bool(spec.quality_set) and rollout.step == 0 and rollout.gate_passed_at is None


def _gate(rollout: Rollout, canary: list[Node], spec: Analysis, now: datetime) -> None:
    """The canary is READY and has no traffic yet: its evaluation set runs against canary and
    baseline, case by case, each version asked by number. It passes, and the step's share goes
    out, or the rollout is rolled back before a single user request reached the canary."""
    run = rollout.gate_run
    if run is None:
        return _gate_start(rollout, canary, spec)
    if not run.finished:
        if now > gate_deadline(run, spec):
            rollout.gate_run = None  # a resume starts a new run
            return pause(
                rollout,
                f"quality gate: evaluation run #{run.pk} did not finish in time (its worker may "
                "have been lost); resume to run it again",
            )
        return None
    verdict, detail = evaluation_verdict(run, spec)
    found = Result(
        "quality before traffic",
        f"evaluation run #{run.pk}: {run.evaluation_set}",
        run.score,
        run.baseline_score,
        spec.quality_min_score,
        verdict,
        detail,
        {"run": run.pk, "passed": run.passed, "failed": run.failed},
    )
    record(rollout, [found], verdict, Round.Kind.GATE)
    if verdict == Verdict.INCONCLUSIVE:
        rollout.gate_run = None  # a resume runs it again
        return pause(rollout, f"quality gate: {detail}; resume to run it again")
    if verdict != Verdict.SUCCESS:
        rollout.first_failure_at = rollout.first_failure_at or now
        return roll_back(rollout, f"quality gate failed before any traffic: {detail}")
    rollout.gate_passed_at = now
    _apply_share(rollout, canary, pool_nodes(rollout))  # now with the step's share of requests
    rollout.step_ready_at = now
    rollout.save()
    return None


def _gate_start(rollout: Rollout, canary: list[Node], spec: Analysis) -> None:
    lead, nodes = members(rollout)[0], pool_nodes(rollout)
    try:
        rollout.gate_run = evaluate(
            rollout, spec, lead=lead, canary=canary, nodes=nodes, when="before traffic"
        )
    except QualityError as exc:
        return pause(rollout, f"quality gate: {exc}")
    rollout.save()
    return None


def _measure(rollout: Rollout, spec: Analysis, compare: bool) -> list[Result]:
    others = [n.name for n in pool_nodes(rollout) if n.name not in rollout.canary_nodes]
    return [
        # A lockstep member's metrics carry its name; any member failing fails the step.
        found
        if member.model == rollout.model
        else replace(found, metric=f"{member.model.name}: {found.metric}")
        for member in members(rollout)
        for found in measure(
            model=member.model.name,
            pool=rollout.pool.name,
            canary_nodes=rollout.canary_nodes,
            # The analysis's own metrics are the rollout's: judged once, with its model's versions.
            spec=spec if member.model == rollout.model else replace(spec, metrics=()),
            budget_ms=member.model.latency_budget_ms,
            steps=changed_steps(member),
            compare=compare,
            slo=Objectives.of(member.model),
            canary_version=member.canary,
            baseline_version=member.baseline,
            baseline_nodes=others,
        )
    ]


def _analyse(rollout: Rollout, spec: Analysis, reading: Measured) -> None:
    now = timezone.now()
    rollout.last_measured_at = now
    results, exc = reading.results, reading.error
    if exc is not None:
        said = Result("prometheus", "", None, None, None, Verdict.ERROR, str(exc))
        record(rollout, [said], Verdict.ERROR)
        rollout.errors += 1
        rollout.last_verdict = Verdict.ERROR
        if rollout.errors >= spec.error_limit and not spec.dry_run:
            return roll_back(
                rollout, f"error: Prometheus failed {rollout.errors} times in a row: {exc}"
            )
        rollout.save()
        return None
    nodes = pool_nodes(rollout)
    lead, canary = members(rollout)[0], _canary(rollout, nodes)
    judged = evaluated(rollout, spec, lead=lead, canary=canary, nodes=nodes)
    results = labelled(rollout, [*results, *judged])
    rollout.errors = 0
    rollout.last_verdict = overall(results, spec.pass_score)
    record(rollout, results, rollout.last_verdict)
    if rollout.last_verdict == Verdict.FAILURE and not spec.dry_run:
        rollout.failures += 1
        rollout.first_failure_at = rollout.first_failure_at or now
        if rollout.failures >= spec.failure_limit:
            failed = [r for r in results if r.verdict == Verdict.FAILURE]
            why = "; ".join(f"{r.metric}: {r.detail}" for r in failed)
            return roll_back(rollout, f"failure: {why}")
    rollout.save()
    return None


# Each handler gets what was measured before the lock; only a rollout going forward measures.
HANDLERS: dict[str, Callable[[Rollout, Measured | None], None]] = {
    State.PENDING: _progress,
    State.PROGRESSING: _progress,
    State.PROMOTING: lambda rollout, _: promote(rollout),
    State.ABORTING: lambda rollout, _: aborting(rollout),
}
