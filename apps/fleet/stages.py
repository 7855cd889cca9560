"""A node's stage (joining, serving, quarantined, departed) changes in one way: set, with when and
why, and recorded in the trail by whoever moved it (discovery, the reconcile, a person)."""

from datetime import datetime
from typing import Any

from django.utils import timezone

from apps.audit.services import Actor, audit_record
from apps.fleet.models import Node


def stage_set(
    node: Node,
    stage: str,
    *,
    actor: Actor,
    action: str,
    message: str,
    reason: str = "",
    result: str = "ok",
    at: datetime | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
) -> None:
    """`node` is at `stage` from `at` (now), `reason` shown on its pages (a quarantine's); the
    event says what it was and is. Other `fields` of the node (what decided it) are written
    with it. Call inside the transaction that decided it."""
    was, at = node.stage, at or timezone.now()
    Node.objects.filter(pk=node.pk).update(
        stage=stage, stage_changed_at=at, stage_reason=reason, **(fields or {})
    )
    node.stage, node.stage_changed_at, node.stage_reason = stage, at, reason
    audit_record(
        actor=actor,
        action=action,
        target=f"node:{node.name}",
        before={"stage": was, **(before or {})},
        after={"stage": stage, **(after or {})},
        result=result,
        message=message,
    )
