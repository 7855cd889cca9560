"""What changed, from the audit trail, as vertical markers on charts."""

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q

from apps.audit.models import AuditEvent


@dataclass(frozen=True)
class Marker:
    at: datetime
    text: str  # the whole story, on hover
    label: str = ""  # a few words on the chart


HEALTH = ["node.down", "node.up", "node.flapping"]
# What changes what a node serves. Listed, not matched by prefix: one IN is several times
# cheaper to build than ORed LIKEs, and a chart pays it on every refresh.
CHANGES = [
    "deployment.set",
    "deployment.remove",
    "operation.load",
    "operation.unload",
    "operation.reload",
    "rollout.step",
    "rollout.promoting",
    "rollout.succeeded",
    "rollout.aborting",
    "rollout.rolled_back",
    "release.rollback",
    "release.fallback",
    *HEALTH,
]
MAX_MARKERS = 60


def change_markers(
    *, start: datetime, end: datetime, model: str = "", node: str = ""
) -> list[Marker]:
    """Deployments, operations, rollout steps and nodes going down or up in [start, end]; only
    `model`'s or `node`'s when given. Targets name both (`pool:demo:rag_pipeline`,
    `node:demo-1:embedder`, `node:demo-1`)."""
    events = AuditEvent.objects.filter(
        Q(result="ok") | Q(action__in=HEALTH),  # a node going down is recorded as a failure
        action__in=CHANGES,
        created_at__range=(start, end),
    )
    if model:
        events = events.filter(target__endswith=f":{model}")
    if node:
        events = events.filter(Q(target=f"node:{node}") | Q(target__startswith=f"node:{node}:"))
    latest = events.order_by("-created_at")[:MAX_MARKERS]
    return [
        Marker(at=event.created_at, text=f"{event.action} {event.target}", label=_label(event))
        for event in reversed(latest)
    ]


def _label(event: AuditEvent) -> str:
    """`deployment.set pool:demo:rag_pipeline {version: 2}` reads `deploy rag_pipeline v2`."""
    verb = {"deployment.set": "deploy", "deployment.remove": "remove"}.get(event.action)
    verb = verb or event.action.split(".", 1)[-1]
    versions = event.after.get("versions") or [event.after.get("version")]
    subject = event.target.rsplit(":", 1)[-1]
    return f"{verb} {subject}" + (f" v{versions[-1]}" if versions[-1] else "")
