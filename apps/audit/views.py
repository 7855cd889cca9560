import csv
import json
from collections.abc import Iterator
from datetime import UTC, datetime

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.http import urlencode

from apps.audit.models import AuditEvent
from apps.audit.selectors import audit_event_list

FILTERS = ("actor", "action", "target", "request", "since", "until")
COLUMNS = [
    "time",
    "actor",
    "action",
    "target",
    "result",
    "before",
    "after",
    "message",
    "request_id",
    "via",
]


def utc_moment(text: str) -> datetime | None:
    """An ISO date and time in UTC (as the filters and permalinks write it), or None."""
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC) if text else None
    except ValueError:
        return None


def _filtered(request: HttpRequest) -> tuple[dict[str, str], list[str], QuerySet[AuditEvent]]:
    filters = {key: request.GET.get(key, "").strip() for key in FILTERS}
    bad = [key for key in ("since", "until") if filters[key] and utc_moment(filters[key]) is None]
    events = audit_event_list(
        actor=filters["actor"],
        action=filters["action"],
        target=filters["target"],
        request_id=filters["request"],
        since=utc_moment(filters["since"]),
        until=utc_moment(filters["until"]),
    )
    return filters, bad, events


def audit_list(request: HttpRequest) -> HttpResponse:
    filters, bad, events = _filtered(request)
    page = Paginator(events, 50).get_page(request.GET.get("page"))
    errors = [f"{key}: expected a date and time such as 2026-11-29T14:05 (UTC)" for key in bad]
    query = urlencode({k: v for k, v in filters.items() if v})
    context = {"page": page, "filters": filters, "errors": errors, "query": query}
    return render(request, "audit/audit_list.html", context)


def event_row(event: AuditEvent) -> dict[str, object]:
    return {
        "time": event.created_at.isoformat(),
        "actor": event.actor,
        "action": event.action,
        "target": event.target,
        "result": event.result,
        "before": event.before,
        "after": event.after,
        "message": event.message,
        "request_id": event.request_id,
        "via": event.via,
    }


def audit_export(request: HttpRequest, fmt: str) -> StreamingHttpResponse:
    """The filtered trail, oldest first, as CSV or JSON, streamed: a long trail never sits in
    memory whole."""
    _, _, events = _filtered(request)
    rows = (event_row(e) for e in events.order_by("created_at", "id").iterator())
    body, kind = (
        (_csv(rows), "text/csv; charset=utf-8")
        if fmt == "csv"
        else (_json(rows), "application/json")
    )
    response = StreamingHttpResponse(body, content_type=kind)
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    response["Content-Disposition"] = f'attachment; filename="audit-{stamp}.{fmt}"'
    return response


class _Line:
    """A file-like target for csv.writer that hands each written line back."""

    def write(self, value: str) -> str:
        return value


# A cell starting with one of these is a formula to a spreadsheet (OWASP's CSV injection).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> str:
    """A cell a spreadsheet shows as text: one that would start a formula (a target or a
    message someone typed, `=HYPERLINK(...)`) gets a leading single quote."""
    text = str(value)
    return f"'{text}" if text.startswith(FORMULA_START) else text


def _csv(rows: Iterator[dict[str, object]]) -> Iterator[str]:
    writer = csv.writer(_Line())
    yield writer.writerow(COLUMNS)
    for row in rows:
        row["before"], row["after"] = json.dumps(row["before"]), json.dumps(row["after"])
        yield writer.writerow([csv_cell(row[column]) for column in COLUMNS])


def _json(rows: Iterator[dict[str, object]]) -> Iterator[str]:
    yield "["
    for index, row in enumerate(rows):
        yield ("," if index else "") + json.dumps(row)
    yield "]"
