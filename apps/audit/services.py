from typing import Any

from django.contrib.auth.models import AnonymousUser, User
from django.db import transaction

from apps.audit.models import AuditEvent


def audit_record(
    *,
    actor: str | User | AnonymousUser,
    action: str,
    target: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    result: str = AuditEvent.Result.OK,
    message: str = "",
) -> AuditEvent:
    """Append one event. Callers run inside their own transaction, so the event commits with
    the change it records, or not at all."""
    user = actor if isinstance(actor, User) else None
    with transaction.atomic():
        return AuditEvent.objects.create(
            actor=actor if isinstance(actor, str) else actor.get_username(),
            user=user,
            action=action,
            target=target,
            before=before or {},
            after=after or {},
            result=result,
            message=message,
        )
