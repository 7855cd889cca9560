"""The incident timeline's reads: its windows, the trail in one with the rollouts' verdict
changes merged in, and what changed."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F
from django.utils import timezone

from apps.audit.models import AuditEvent, target_parts
from apps.fleet.models import Operation
from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.verdicts import Verdict

# The longest timeline window a page, a report or the API reads: bounded work per request.
MAX_WINDOW = timedelta(days=31)
# The most audit events one timeline page, report or API answer holds; the rest is linked.
MAX_EVENTS = 2_000
MARGIN = timedelta(minutes=5)
WORST_FIRST = [
    Verdict.FAILURE,
    Verdict.ERROR,
    Verdict.INCONCLUSIVE,
    Verdict.MARGINAL,
    Verdict.SUCCESS,
]


def window_valid(start: datetime, end: datetime) -> bool:
    """A start before the end, MAX_WINDOW apart at most."""
    try:
        return start < end <= start + MAX_WINDOW
    except OverflowError:  # a window reaching past year 9999
        return False


def around(at: datetime, span: timedelta) -> tuple[datetime, datetime] | None:
    """`span` centred on `at`, or None where it would reach past year 1 or 9999."""
    try:
        return at - span / 2, at + span / 2
    except OverflowError:
        return None


def span_of(*, rollout: int = 0, operation: int = 0) -> tuple[datetime, datetime, str, str] | None:
    """(start, end, model, title) of the rollout with that id, or else the operation (no row
    has id 0): the incident review window of its span, five minutes either side, never past
    now; None where there is neither."""
    ran = Rollout.objects.filter(pk=rollout).first()
    if ran is not None:
        title = f"rollout #{ran.pk}: {ran}"
        return *_span(ran.created_at, ran.finished_at), ran.model.name, title
    done = Operation.objects.filter(pk=operation).first()
    if done is not None:
        title = f"operation #{done.pk}: {done}"
        return *_span(done.created_at, done.finished_at), done.model_name, title
    return None


def _span(begun: datetime, finished: datetime | None) -> tuple[datetime, datetime]:
    now = timezone.now()
    return begun - MARGIN, min(now, (finished or now) + MARGIN)


def timeline_events(start: datetime, end: datetime) -> tuple[list[AuditEvent], datetime | None]:
    """The trail in [start, end], oldest first, with the rollouts' verdict changes merged in: at
    most MAX_EVENTS of it, and then the time it stopped at, where the rest goes on (else None)."""
    window = AuditEvent.objects.filter(created_at__range=(start, end))
    trail = list(window.order_by("created_at", "id")[: MAX_EVENTS + 1])
    more = trail[MAX_EVENTS].created_at if len(trail) > MAX_EVENTS else None
    shown = [*trail[:MAX_EVENTS], *verdict_changes(start, more or end)]
    return sorted(shown, key=lambda e: e.created_at), more


def verdict_changes(start: datetime, end: datetime) -> list[AuditEvent]:
    """Each rollout's rounds in [start, end], for the timeline: a round appears when its verdict
    differs from the round before it in the same step, so that a steady rollout reads as one line
    per step, and the round that turned it shows what did not pass. Read from the rounds (the
    verdict is the round's own: a marginal round reads marginal), as unsaved `rollout.verdict`
    events; nothing is written. Two queries, however many rounds."""
    rounds = (
        Round.objects.filter(taken_at__range=(start, end))
        .annotate(model_name=F("rollout__model__name"))
        .order_by("rollout_id", "taken_at", "id")
    )
    turned: list[Round] = []
    previous: tuple[int, int, str] | None = None
    for found in rounds:
        key = (found.rollout_id, found.step, found.verdict)
        if key != previous:
            turned.append(found)
        previous = key
    # Only what a verdict line says is read of the measurements (not the evidence or query).
    shown = (
        Measurement.objects.filter(round__in=[r.pk for r in turned if r.verdict != Verdict.SUCCESS])
        .exclude(verdict=Verdict.SUCCESS)
        .only(*_VERDICT_FIELDS)
        .order_by("id")
    )
    why: dict[int, list[Measurement]] = {}
    for measured in shown:
        why.setdefault(measured.round_id, []).append(measured)  # type: ignore[arg-type]
    changes = []
    for turn in turned:
        target = f"rollout:{turn.rollout_id}:{turn.model_name}"  # type: ignore[attr-defined]
        worst = sorted(why.get(turn.pk, []), key=lambda m: WORST_FIRST.index(Verdict(m.verdict)))
        changes.append(
            AuditEvent(
                created_at=turn.taken_at,
                actor="system:rollouts",
                action="rollout.verdict",
                target=target,
                **target_parts(target),
                result="ok" if turn.verdict == Verdict.SUCCESS else "failed",
                message=f"step {turn.step + 1}: {turn.verdict}"
                + "".join(f"; {m.metric} {_values(m)}" for m in worst[:3]),
            )
        )
    return changes


_VERDICT_FIELDS = ("round", "metric", "canary_value", "threshold", "verdict", "detail")


def _values(m: Measurement) -> str:
    if m.detail or m.canary_value is None or m.threshold is None:
        return m.detail
    return f"{m.canary_value:.4g} (threshold {m.threshold:.4g})"


@dataclass(frozen=True)
class Change:
    """What a pool (or node) ran of a model before a window and after it."""

    target: str  # pool:<pool>:<model> or node:<node>:<model>
    before: int | None
    after: int | None


def what_changed(events: list[AuditEvent]) -> list[Change]:
    """Versions before and after, per deployment target, from the deployments in `events`, and
    in their parts (a rollback's own deployment changes)."""
    first: dict[str, int | None] = {}
    last: dict[str, int | None] = {}
    for event in events:
        if event.result != "ok":
            continue
        for change in [*event.after.get("parts", []), event.as_part()]:
            if change["action"] in ("deployment.set", "deployment.remove"):
                first.setdefault(change["target"], change.get("before", {}).get("version"))
                last[change["target"]] = change.get("after", {}).get("version")
    return [
        Change(target, first[target], last[target])
        for target in sorted(last)
        if first[target] != last[target]
    ]


def affected(events: list[AuditEvent]) -> tuple[list[str], list[str]]:
    """The models and nodes the events' targets name, in order of first mention."""
    models: dict[str, None] = {}
    nodes: dict[str, None] = {}
    for event in events:
        if event.target_type == "node":
            nodes[event.target_name] = None
        if event.target_model:
            models[event.target_model] = None
    return list(models), list(nodes)
