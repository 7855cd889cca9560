"""What changed, from the audit trail, as vertical markers on charts."""

from datetime import datetime

from django.db.models import Q

from apps.audit.models import AuditEvent
from apps.observability.charts import Marker

CHANGES = ("deployment.", "operation.load", "operation.unload", "operation.reload", "rollout.")
MAX_MARKERS = 60


def change_markers(*, start: datetime, end: datetime, model: str = "") -> list[Marker]:
    """Deployments, operations and rollout steps in [start, end]; only `model`'s when given.
    Targets end with the model's name (`pool:demo:rag_pipeline`, `node:demo-1:embedder`)."""
    kinds = Q()
    for prefix in CHANGES:
        kinds |= Q(action__startswith=prefix)
    events = AuditEvent.objects.filter(kinds, created_at__range=(start, end), result="ok")
    if model:
        events = events.filter(target__endswith=f":{model}")
    latest = events.order_by("-created_at")[:MAX_MARKERS]
    return [
        Marker(at=event.created_at, text=f"{event.action} {event.target}")
        for event in reversed(latest)
    ]
