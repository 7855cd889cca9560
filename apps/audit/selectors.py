from django.db.models import QuerySet

from apps.audit.models import AuditEvent


def audit_event_list(
    *, actor: str = "", action: str = "", target: str = ""
) -> QuerySet[AuditEvent]:
    events = AuditEvent.objects.all()
    if actor:
        events = events.filter(actor=actor)
    if action:
        events = events.filter(action__startswith=action)
    if target:
        events = events.filter(target__icontains=target)
    return events
