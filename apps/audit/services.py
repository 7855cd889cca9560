from collections.abc import Callable, Sequence
from contextvars import ContextVar
from functools import cache, wraps
from typing import Any, TypeVar, cast

from django.contrib.auth.models import AnonymousUser, User
from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.db.models import Model
from django.utils import timezone

from apps.audit.actions import ACTIONS
from apps.audit.context import REQUEST_ID, VIA
from apps.audit.models import AuditEvent, target_parts
from apps.web.bulk import bulk_insert
from apps.web.prepared import prepared_cursor

Actor = str | User  # a person, or `system:<component>`


def actor_name(actor: str | User | AnonymousUser) -> str:
    """How an actor stands in the trail: a username, or `system:<component>`."""
    return actor if isinstance(actor, str) else actor.get_username()


# The events of the action under way, kept until it ends: an action is one event, and what the
# services it calls record along the way become that event's parts.
_ACTION: ContextVar[list[AuditEvent] | None] = ContextVar("audit_action", default=None)
# The name of the innermost audited service under way: the action its events are recorded as,
# unless they name another.
_NAMED: ContextVar[str] = ContextVar("audit_named", default="")


def audit_event(
    *,
    actor: str | User | AnonymousUser,
    target: str,
    action: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    result: str = AuditEvent.Result.OK,
    message: str = "",
) -> AuditEvent:
    """An event as `audit_record` appends it, not written yet; its action is that of the
    innermost `audited` service under way, unless named."""
    action = action or _NAMED.get()
    if action not in ACTIONS:
        raise ValueError(f"{action!r} is not an audit action: name it in apps/audit/actions.py")
    return AuditEvent(
        actor=actor_name(actor),
        user=actor if isinstance(actor, User) else None,
        action=action,
        target=target,
        **target_parts(target),  # its columns, set now: defaults built to be replaced cost more
        before=before or {},
        after=after or {},
        result=result,
        message=message,
        request_id=REQUEST_ID.get(),
        via=VIA.get(),
    )


def audit_record(**fields: Any) -> AuditEvent:
    """Append one event (`audit_event`'s fields). Callers run inside their own transaction, so
    the event commits with the change it records, or not at all. Within an `audited` service
    the event is held back and written when the service ends, as that action's event or one of
    its parts."""
    return _append(audit_event(**fields))


def audit_append(events: list[AuditEvent]) -> None:
    """Append events made by `audit_event`, in one statement (held back, as `audit_record`'s
    are, within an `audited` service): a chunk of a release plans many nodes at once."""
    if _ACTION.get() is not None:
        for event in events:
            _append(event)
        return
    bulk_insert(events)


def _append(event: AuditEvent) -> AuditEvent:
    held = _ACTION.get()
    if held is not None:
        held.append(event)
    else:
        event.save()
    return event


# An UPDATE written out, and its parameters: its WHERE clause comes last, its conditions ANDed
# (a condition may be added to it). Written once by its caller: built by the ORM, a statement a
# release runs thousands of times cost more to compile than to run.
Statement = tuple[str, Sequence[Any]]


def audit_update(
    changing: Statement, event: AuditEvent, then: Statement | None = None
) -> tuple[int, int]:
    """`changing` and, if it changed any row, `event` (from `audit_event`) appended with it and
    `then` run, atomically. Returns how many rows each update changed. On PostgreSQL, outside
    an `audited` service, it is one statement, its own transaction unless the caller has one:
    a release records each load of thousands of nodes this way, and claims the next one with
    it."""
    if connection.vendor != "postgresql" or _ACTION.get() is not None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(*changing)
            if not (changed := cursor.rowcount):
                return 0, 0
            _append(event)
            if not then:
                return changed, 0
            cursor.execute(*then)
            return changed, cursor.rowcount
    event.created_at = timezone.now()
    # Every column but those the database fills (the id, and the user when there is none).
    columns = [f for f in _EVENT_FIELDS if getattr(event, f.attname) is not None]
    row = [f.get_db_prep_save(getattr(event, f.attname), connection) for f in columns]
    logged = _logged(tuple(f.attname for f in columns))
    # Made of the callers' written-out UPDATEs and the model's own names; every value a parameter.
    statement = f"WITH changed AS ({changing[0]} RETURNING 1), {logged}"
    followed, more = "0", ()
    if then:
        following = f"{then[0]} AND EXISTS (SELECT 1 FROM changed)"  # noqa: S608
        statement += f", followed AS ({following} RETURNING 1)"
        followed, more = "(SELECT count(*) FROM followed)", tuple(then[1])
    statement += f" SELECT (SELECT count(*) FROM changed), {followed}"  # noqa: S608
    with prepared_cursor() as cursor:
        cursor.execute(statement, (*changing[1], *row, *more))
        changed, follows = cursor.fetchone()
    return changed, follows


_EVENT_FIELDS = [f for f in AuditEvent._meta.concrete_fields if not f.primary_key]


@cache
def _logged(attnames: tuple[str, ...]) -> str:
    """The CTE that inserts an event of these columns for each changed row, each value cast: a
    SELECT list does not take its types from the table it feeds. Built once per set of columns:
    their types cost more to look up than the statement takes to run."""
    columns = [f for f in _EVENT_FIELDS if f.attname in attnames]
    names = ", ".join(connection.ops.quote_name(f.column) for f in columns)
    casts = ", ".join(f"%s::{f.db_type(connection)}" for f in columns)
    table = connection.ops.quote_name(AuditEvent._meta.db_table)
    return f"logged AS (INSERT INTO {table} ({names}) SELECT {casts} FROM changed)"  # noqa: S608


def fields_set(row: Model, values: dict[str, Any], *, actor: Actor, target: str) -> dict[str, Any]:
    """The one way a service changes settings of a (locked) row: the fields `values` changes
    are set and saved, and recorded as one event of the service under way, before and after;
    nothing is written when nothing changed (a repeated click). Returns what changed."""
    changed = {name: value for name, value in values.items() if getattr(row, name) != value}
    if changed:
        before = {name: getattr(row, name) for name in changed}
        audit_record(actor=actor, target=target, before=before, after=changed)
        for name, value in changed.items():
            setattr(row, name, value)
        row.save(update_fields=list(changed))
    return changed


def _record_action(events: list[AuditEvent]) -> None:
    """The action's own event is the last one it recorded; the rest are listed in it as parts."""
    if not events:
        return  # nothing changed: a repeated click
    *parts, own = events
    if parts:
        own.after = own.after | {"parts": [event.as_part() for event in parts]}
    own.save()


def _holding(service: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Any, list[AuditEvent]]:
    """The service's result, with the events it recorded held back instead of written."""
    held: list[AuditEvent] = []
    token = _ACTION.set(held)
    try:
        return service(**kwargs), held
    finally:
        _ACTION.reset(token)


F = TypeVar("F", bound=Callable[..., Any])


def audited(
    action: str | Callable[..., str],
    target: Callable[..., str],
    refusals: tuple[type[Exception], ...] = (),
) -> Callable[[F], F]:
    """A mutating service (called with keyword arguments, `actor` among them): one action, one
    event. It runs in its own transaction; services it calls are steps of the same action, and
    their events become parts of its event. When it refuses, raising one of `refusals`, its
    changes roll back but the refusal is recorded, after that transaction, and raised to the
    caller: a failed action is in the trail too, and so is one refused for want of a role
    (PermissionDenied)."""

    def decorator(service: F) -> F:
        @wraps(service)
        def wrapped(**kwargs: Any) -> Any:
            named = _NAMED.set(action if isinstance(action, str) else action(**kwargs))
            try:
                return _run(kwargs)
            finally:
                _NAMED.reset(named)

        def _run(kwargs: dict[str, Any]) -> Any:
            if _ACTION.get() is not None:  # a step of an action already under way
                with transaction.atomic():
                    return service(**kwargs)
            try:
                with transaction.atomic():
                    result, held = _holding(service, kwargs)
                    _record_action(held)
                    return result
            except (PermissionDenied, *refusals) as exc:  # type: ignore[misc]  # a tuple of them
                audit_record(
                    actor=kwargs["actor"],
                    target=target(**kwargs),
                    result=(
                        AuditEvent.Result.DENIED
                        if isinstance(exc, PermissionDenied)
                        else AuditEvent.Result.FAILED
                    ),
                    message=str(exc),
                )
                raise

        wrapped.audited = action  # type: ignore[attr-defined]  # tests find every service by it
        return cast(F, wrapped)

    return decorator
