from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from django.contrib.auth.models import AnonymousUser, User
from django.db import transaction

from apps.audit.models import AuditEvent


def actor_name(actor: str | User | AnonymousUser) -> str:
    """How an actor stands in the trail: a username, or `system:<component>`."""
    return actor if isinstance(actor, str) else actor.get_username()


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
            actor=actor_name(actor),
            user=user,
            action=action,
            target=target,
            before=before or {},
            after=after or {},
            result=result,
            message=message,
        )


F = TypeVar("F", bound=Callable[..., Any])


def refusals_audited(
    action: str | Callable[..., str],
    target: Callable[..., str],
    refusals: tuple[type[Exception], ...],
) -> Callable[[F], F]:
    """Run a service (called with keyword arguments, `actor` among them) in its own transaction.
    When it refuses, raising one of `refusals`, its changes roll back but the refusal is recorded,
    after that transaction, and raised to the caller: a failed action is in the trail too."""

    def decorator(service: F) -> F:
        @wraps(service)
        def wrapped(**kwargs: Any) -> Any:
            try:
                with transaction.atomic():
                    return service(**kwargs)
            except refusals as exc:
                audit_record(
                    actor=kwargs["actor"],
                    action=action if isinstance(action, str) else action(**kwargs),
                    target=target(**kwargs),
                    result=AuditEvent.Result.FAILED,
                    message=str(exc),
                )
                raise

        return cast(F, wrapped)

    return decorator
