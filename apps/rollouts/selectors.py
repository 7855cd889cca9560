from datetime import datetime, timedelta

from apps.audit.models import AuditEvent
from apps.rollouts.models import Measurement

Verdict = Measurement.Verdict
# One analysis round's rows are written within one tick; rounds are a whole interval apart.
ROUND_GAP = timedelta(seconds=0.5)
WORST_FIRST = [Verdict.FAILURE, Verdict.ERROR, Verdict.INCONCLUSIVE, Verdict.SUCCESS]


def timeline_events(start: datetime, end: datetime) -> list[AuditEvent]:
    """The trail in [start, end], oldest first, with the rollouts' verdict changes merged in."""
    trail = AuditEvent.objects.filter(created_at__range=(start, end)).order_by("created_at", "id")
    return sorted([*trail, *verdict_changes(start, end)], key=lambda e: e.created_at)


def verdict_changes(start: datetime, end: datetime) -> list[AuditEvent]:
    """Each rollout's analysis verdicts in [start, end], for the timeline: a round appears when
    its verdict differs from the round before it in the same step, so that a steady rollout reads
    as one line per step, and the round that turned it shows what failed. Derived from the
    measurements, as unsaved `rollout.verdict` events; nothing is written."""
    rows = Measurement.objects.filter(taken_at__range=(start, end)).select_related("rollout__model")
    rounds: list[list[Measurement]] = []
    for row in rows.order_by("rollout_id", "taken_at", "id"):
        last = rounds[-1][-1] if rounds else row
        same = (last.rollout_id, last.step) == (row.rollout_id, row.step)
        if rounds and same and row.taken_at - last.taken_at <= ROUND_GAP:
            rounds[-1].append(row)
        else:
            rounds.append([row])
    changes: list[AuditEvent] = []
    previous: tuple[int, int, str] | None = None
    for found in rounds:
        verdict = next(v for v in WORST_FIRST if any(m.verdict == v for m in found))
        first = found[0]
        key = (first.rollout_id, first.step, verdict)
        if key != previous:
            worst = [m for m in found if m.verdict == verdict != Verdict.SUCCESS]
            changes.append(
                AuditEvent(
                    created_at=first.taken_at,
                    actor="system:rollouts",
                    action="rollout.verdict",
                    target=f"rollout:{first.rollout_id}:{first.rollout.model.name}",
                    result="ok" if verdict == Verdict.SUCCESS else "failed",
                    message=f"step {first.step + 1}: {verdict}"
                    + "".join(f"; {m.metric} {_values(m)}" for m in worst[:3]),
                )
            )
        previous = key
    return changes


def _values(m: Measurement) -> str:
    if m.detail or m.canary_value is None or m.threshold is None:
        return m.detail
    return f"{m.canary_value:.4g} (threshold {m.threshold:.4g})"
