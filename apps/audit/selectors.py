from datetime import datetime

from django.db.models import QuerySet

from apps.audit.models import AuditEvent


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
