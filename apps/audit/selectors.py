from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet

from apps.audit.models import AuditEvent


def audit_event_list(
    *,
    actor: str = "",
    action: str = "",
    target: str = "",
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
    if since:
        events = events.filter(created_at__gte=since)
    if until:
        events = events.filter(created_at__lte=until)
    return events


@dataclass(frozen=True)
class Change:
    """What a pool (or node) ran of a model before a window and after it."""

    target: str  # pool:<pool>:<model> or node:<node>:<model>
    before: int | None
    after: int | None


def what_changed(events: list[AuditEvent]) -> list[Change]:
    """Versions before and after, per deployment target, from the deployments in `events`."""
    first: dict[str, int | None] = {}
    last: dict[str, int | None] = {}
    for event in events:
        if event.action not in ("deployment.set", "deployment.remove") or event.result != "ok":
            continue
        first.setdefault(event.target, event.before.get("version"))
        last[event.target] = event.after.get("version")
    return [
        Change(target, first[target], last[target])
        for target in sorted(last)
        if first[target] != last[target]
    ]
