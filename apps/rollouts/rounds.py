"""A step's analysis rounds: measured ahead of the rollout's lock (Prometheus may take its
whole timeout), judged under it when due, with the evaluation run that finished since and the
synthetic requests that the step made; each round a row (apps/rollouts/results.py)."""

from dataclasses import dataclass, field, replace
from datetime import datetime

from django.utils import timezone

from apps.prometheus.client import PrometheusUnavailable
from apps.rollouts.analysis import measure, overall
from apps.rollouts.ending import roll_back
from apps.rollouts.gate import evaluated
from apps.rollouts.members import Scope, judged_by, scope
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind, Result
from apps.rollouts.slo import Objectives
from apps.rollouts.transitions import State, record
from apps.rollouts.verdicts import Verdict


@dataclass(frozen=True)
class Measured:
    """An analysis round measured before the rollout's lock was taken, of the rollout as it was
    then (`of`, as `as_measured` says)."""

    of: tuple[object, ...]
    results: list[Result] = field(default_factory=list)
    error: PrometheusUnavailable | None = None


def as_measured(rollout: Rollout, compare: bool) -> tuple[object, ...]:
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


def due(rollout: Rollout, spec: Analysis, now: datetime) -> bool:
    """Judged on whole windows of canary traffic, after the load's own spike has passed, every
    interval."""
    if rollout.step_ready_at is None:
        return False
    warm = (now - rollout.step_ready_at).total_seconds() >= spec.warmup_s + spec.window_s
    return warm and (
        rollout.last_measured_at is None
        or (now - rollout.last_measured_at).total_seconds() >= spec.interval_s
    )


def measure_ahead(rollout_id: int) -> Measured | None:
    """The round a tick is about to judge, if one is due, read without any lock."""
    found = Rollout.objects.select_related("model", "pool").filter(pk=rollout_id).first()
    if found is None or found.state != State.PROGRESSING or found.step_started_at is None:
        return None
    if found.strategy == Rollout.Strategy.BLUE_GREEN:
        return None  # judged on its evaluations alone
    spec = Analysis.from_dict(found.analysis)
    if not due(found, spec, timezone.now()):
        return None
    where = scope(found)
    of = as_measured(found, where.compare)
    try:
        return Measured(of, results=_measure(found, spec, where))
    except PrometheusUnavailable as exc:
        return Measured(of, error=exc)


def _measure(rollout: Rollout, spec: Analysis, where: Scope) -> list[Result]:
    others = [n.name for n in where.nodes if n.name not in rollout.canary_nodes]
    return [
        # A lockstep member's results carry its name; any member failing fails the step.
        found if member.model == rollout.model else replace(found, member=member.model.name)
        for member in where.released
        for judged in [judged_by(member)]
        for found in measure(
            model=member.model.name,
            pool=rollout.pool.name,
            canary_nodes=rollout.canary_nodes,
            # The analysis's own metrics are the rollout's: judged once, with its model's versions.
            spec=spec if member.model == rollout.model else replace(spec, metrics=()),
            budget_ms=member.model.latency_budget_ms,
            steps=judged.steps,
            llm=judged.speaker,
            compare=where.compare,
            slo=Objectives.of(member.model),
            canary_version=member.canary,
            baseline_version=member.baseline,
            baseline_nodes=others,
        )
    ]


def judged(
    rollout: Rollout, spec: Analysis, reading: Measured | None, where: Scope, now: datetime
) -> bool:
    """Judge the round that is due, if one is; whether the step may go on in this tick: not
    while the reading is of the rollout as it was before it moved (measured on the next tick),
    nor once the round rolled it back."""
    if not due(rollout, spec, now):
        return True
    if reading is None or reading.of != as_measured(rollout, where.compare):
        return False
    _analyse(rollout, spec, reading, evaluated(rollout, spec, where))
    return rollout.state == State.PROGRESSING


def _analyse(rollout: Rollout, spec: Analysis, reading: Measured, judged: list[Result]) -> None:
    """The round read ahead, with the evaluation run that finished since (`judged`): a failure
    counts toward rolling back, Prometheus away toward rolling back on errors (a dry run records
    and goes on)."""
    now = timezone.now()
    rollout.last_measured_at = now
    results, exc = reading.results, reading.error
    if exc is not None:
        said = Result(
            "prometheus", "", None, None, None, Verdict.ERROR, str(exc), kind=Kind.PROMETHEUS
        )
        record(rollout, [said], Verdict.ERROR)
        rollout.errors += 1
        rollout.last_verdict = Verdict.ERROR
        if rollout.errors >= spec.error_limit and not spec.dry_run:
            return roll_back(
                rollout, f"error: Prometheus failed {rollout.errors} times in a row: {exc}"
            )
        rollout.save()
        return None
    results = labelled(rollout, [*results, *judged])
    rollout.errors = 0
    rollout.last_verdict = overall(results, spec.pass_score)
    record(rollout, results, rollout.last_verdict)
    if rollout.last_verdict == Verdict.FAILURE and not spec.dry_run:
        rollout.failures += 1
        rollout.first_failure_at = rollout.first_failure_at or now
        if rollout.failures >= spec.failure_limit:
            failed = [r for r in results if r.verdict == Verdict.FAILURE]
            why = "; ".join(f"{r.name}: {r.detail}" for r in failed)
            return roll_back(rollout, f"failure: {why}")
    rollout.save()
    return None


def labelled(rollout: Rollout, results: list[Result]) -> list[Result]:
    """The round's request counts of the rollout's own model, saying which of them the rollout
    made."""
    load = rollout.synthetic_load
    if load is None:
        return results
    note = (
        f"{load.rps:g} synthetic requests/s from {load.evaluation_set} to "
        f"{', '.join(load.nodes)} since {load.created_at:%H:%M:%S}"
    )
    made = {"load": load.pk, "rps": load.rps, "nodes": load.nodes, "sent": load.sent}
    return [
        replace(
            r,
            detail="; ".join(filter(None, [r.detail, note])),
            evidence=r.evidence | {"synthetic": made},
        )
        if r.kind == Kind.REQUESTS and not r.member  # the lead's: the requests made are to it
        else r
        for r in results
    ]
