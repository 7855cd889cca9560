from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import QuerySet
from django.utils import timezone

from apps.audit.models import AuditEvent

# The longest timeline window a page, a report or the API reads: bounded work per request.
MAX_WINDOW = timedelta(days=31)


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


def audit_event_list(
    *,
    actor: str = "",
    action: str = "",
    target: str = "",
    request_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[AuditEvent]:
    events = AuditEvent.objects.all()
    if actor:
        events = events.filter(actor=actor)
    if action:
        events = events.filter(action__startswith=action)
    if target:
        events = events.filter(target__icontains=target)
    if request_id:
        events = events.filter(request_id=request_id)
    if since:
        events = events.filter(created_at__gte=since)
    if until:
        events = events.filter(created_at__lte=until)
    return events


MARGIN = timedelta(minutes=5)


def span_window(begun: datetime, finished: datetime | None) -> tuple[datetime, datetime]:
    """The incident review window of something that ran from `begun` to `finished` (or runs
    still): its span with five minutes either side, never past now."""
    now = timezone.now()
    return begun - MARGIN, min(now, (finished or now) + MARGIN)


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
    """The models and nodes the events' targets name (`pool:<pool>:<model>`, `node:<node>`,
    `node:<node>:<model>`, `model:<model>:v<n>`, `rollout:<id>:<model>`), in order of first
    mention."""
    models: dict[str, None] = {}
    nodes: dict[str, None] = {}
    for event in events:
        kind, _, rest = event.target.partition(":")
        name, _, model = rest.partition(":")
        if kind == "node":
            nodes[name] = None
        if kind == "model":
            models[name] = None
        elif kind in ("pool", "node", "rollout") and model:
            models[model] = None
    return list(models), list(nodes)
