"""The audit trail and the incident timeline, read-only."""

from datetime import UTC, datetime, timedelta
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Router, Schema

from apps.api.auth import Token
from apps.api.errors import ERRORS, ApiError
from apps.audit.models import AuditEvent
from apps.audit.selectors import audit_event_list
from apps.incidents.timeline import (
    MAX_WINDOW,
    span_of,
    timeline_events,
    what_changed,
    window_valid,
)

router = Router(tags=["audit"], auth=Token())


class EventOut(Schema):
    id: int | None  # None: a rollout's verdict change, read from its measurements, not stored
    time: datetime
    actor: str
    action: str
    target: str
    result: str
    before: dict[str, Any]
    after: dict[str, Any]
    message: str
    request_id: str
    via: str


class ChangeOut(Schema):
    target: str
    before: int | None
    after: int | None


class TimelineOut(Schema):
    start: datetime
    end: datetime
    changes: list[ChangeOut]
    events: list[EventOut]
    # Set when the window holds more events than one answer: ask again from this time.
    more_from: datetime | None = None


def _utc(name: str, value: datetime | None) -> datetime | None:
    """A time as PostgreSQL takes it: with a zone, converted to UTC (it refuses offsets past
    16 hours, which ISO 8601 allows up to 24)."""
    if value is None:
        return None
    if timezone.is_naive(value):
        raise ApiError(422, "invalid_request", f"{name}: give a time zone (Z for UTC)")
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ApiError(422, "invalid_request", f"{name}: out of range") from None


def _event_out(event: AuditEvent) -> dict[str, Any]:
    fields = ["id", "actor", "action", "target", "result", "before", "after", "message"]
    return {"time": event.created_at, "request_id": event.request_id, "via": event.via} | {
        f: getattr(event, f) for f in fields
    }


@router.get("/audit", response={200: list[EventOut], **ERRORS})
def list_audit_events(
    request: HttpRequest,
    actor: str = "",
    action: str = "",
    target: str = "",
    request_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """Newest first; `action` matches a prefix (`rollout.`), `target` a part."""
    found = audit_event_list(
        actor=actor,
        action=action,
        target=target,
        request_id=request_id,
        since=_utc("since", since),
        until=_utc("until", until),
    )
    offset = max(0, offset)
    return [_event_out(e) for e in found[offset : offset + max(1, min(limit, 1000))]]


@router.get("/timeline", response={200: TimelineOut, **ERRORS})
def get_timeline(
    request: HttpRequest,
    start: datetime | None = None,
    end: datetime | None = None,
    rollout: int | None = None,
    operation: int | None = None,
) -> dict[str, Any]:
    """What changed in a window, oldest first, with versions before and after per target: give
    `start` and `end`, or a `rollout` or an `operation` for its span; the last hour otherwise."""
    start, end = _utc("start", start), _utc("end", end)
    if rollout is not None or operation is not None:
        ran = span_of(rollout=rollout or 0, operation=operation or 0)
        if ran is None:
            raise ApiError(404, "not_found", "no such rollout or operation")
        start, end, _, _ = ran
    try:
        end = end or timezone.now()
        start = start or end - timedelta(hours=1)
    except OverflowError:  # a window reaching past year 1
        start = None
    if start is None or end is None or not window_valid(start, end):
        message = f"start must come before end, {MAX_WINDOW.days} days at most"
        raise ApiError(422, "invalid_request", message)
    found, more = timeline_events(start, end)
    changes = [vars(change) for change in what_changed(found)]
    return {
        "start": start,
        "end": end,
        "changes": changes,
        "events": [_event_out(e) for e in found],
        "more_from": more,
    }
