import csv
import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import cast

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.utils.text import slugify

from apps.audit.models import AuditEvent
from apps.audit.selectors import (
    MAX_WINDOW,
    affected,
    around,
    audit_event_list,
    span_window,
    what_changed,
    window_valid,
)
from apps.fleet.models import Operation
from apps.observability.charts import Chart, metric_chart
from apps.rollouts.models import Rollout
from apps.rollouts.selectors import timeline_events

MAX_CHARTS = 8
WINDOWS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}
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


def _moment(text: str) -> datetime | None:
    """An ISO date and time in UTC (as the filters and permalinks write it), or None."""
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC) if text else None
    except ValueError:
        return None


def _filtered(request: HttpRequest) -> tuple[dict[str, str], list[str], QuerySet[AuditEvent]]:
    filters = {key: request.GET.get(key, "").strip() for key in FILTERS}
    bad = [key for key in ("since", "until") if filters[key] and _moment(filters[key]) is None]
    events = audit_event_list(
        actor=filters["actor"],
        action=filters["action"],
        target=filters["target"],
        request_id=filters["request"],
        since=_moment(filters["since"]),
        until=_moment(filters["until"]),
    )
    return filters, bad, events


def audit_list(request: HttpRequest) -> HttpResponse:
    filters, bad, events = _filtered(request)
    page = Paginator(events, 50).get_page(request.GET.get("page"))
    errors = [f"{key}: expected a date and time such as 2026-11-29T14:05 (UTC)" for key in bad]
    query = urlencode({k: v for k, v in filters.items() if v})
    context = {"page": page, "filters": filters, "errors": errors, "query": query}
    return render(request, "audit/audit_list.html", context)


def _row(event: AuditEvent) -> dict[str, object]:
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
    rows = (_row(e) for e in events.order_by("created_at", "id").iterator())
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


def _csv(rows: Iterator[dict[str, object]]) -> Iterator[str]:
    writer = csv.writer(_Line())
    yield writer.writerow(COLUMNS)
    for row in rows:
        row["before"], row["after"] = json.dumps(row["before"]), json.dumps(row["after"])
        yield writer.writerow([row[column] for column in COLUMNS])


def _json(rows: Iterator[dict[str, object]]) -> Iterator[str]:
    yield "["
    for index, row in enumerate(rows):
        yield ("," if index else "") + json.dumps(row)
    yield "]"


def _window(request: HttpRequest) -> tuple[datetime, datetime, str, str, str]:
    """(start, end, model, title, preset): an absolute start and end (a permalink), a rollout's
    or an operation's span with five minutes either side, a preset around a given time, or a
    preset before now."""
    get = request.GET.get
    start_at, end_at = _moment(get("start", "")), _moment(get("end", ""))
    if start_at and end_at and window_valid(start_at, end_at):
        return start_at, end_at, get("model", ""), "", ""
    rollout = Rollout.objects.filter(pk=_number(get("rollout", ""))).first()
    if rollout is not None:
        start, end = span_window(rollout.created_at, rollout.finished_at)
        return start, end, rollout.model.name, f"rollout #{rollout.pk}: {rollout}", ""
    operation = Operation.objects.filter(pk=_number(get("operation", ""))).first()
    if operation is not None:
        start, end = span_window(operation.created_at, operation.finished_at)
        return start, end, operation.model_name, f"operation #{operation.pk}: {operation}", ""
    preset = get("window", "1h") if get("window", "1h") in WINDOWS else "1h"
    at = _moment(get("at", ""))
    span = around(at, WINDOWS[preset]) if at else None
    if at and span:
        return *span, "", f"{preset} around {at:%Y-%m-%d %H:%M} UTC", preset
    end = timezone.now()
    return end - WINDOWS[preset], end, "", f"last {preset}", preset


def _window_error(request: HttpRequest) -> str:
    """What was wrong with the window asked for (the last hour is shown instead), or ""."""
    get = request.GET.get
    if get("start") or get("end"):
        start_at, end_at = _moment(get("start", "")), _moment(get("end", ""))
        if not (start_at and end_at and window_valid(start_at, end_at)):
            return (
                f"start, end: a start before the end, {MAX_WINDOW.days} days apart at most, "
                "such as 2026-11-29T14:05 (UTC)"
            )
    at = _moment(get("at", ""))
    if get("at") and (at is None or around(at, WINDOWS["24h"]) is None):
        return "at: expected a date and time such as 2026-11-29T14:05 (UTC)"
    return ""


def _number(text: str) -> int:
    return int(text) if text.isdecimal() else 0  # no row has id 0


def _timeline_context(request: HttpRequest) -> dict[str, object]:
    start, end, model, title, preset = _window(request)
    events = timeline_events(start, end)
    # Written to the second, the end rounded up: nothing of the window falls out of its link.
    last = end.replace(microsecond=0) + timedelta(seconds=1 if end.microsecond else 0)
    fixed = {"start": f"{start:%Y-%m-%dT%H:%M:%S}", "end": f"{last:%Y-%m-%dT%H:%M:%S}"}
    fixed |= {"model": model} if model else {}
    permalink = request.build_absolute_uri(f"{reverse('audit:timeline')}?{urlencode(fixed)}")
    return {
        "fixed": {"start": fixed["start"], "end": fixed["end"]},
        "events": events,
        "changes": what_changed(events),
        "start": start,
        "end": end,
        "model": model,
        "title": title or f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} UTC",
        "window": preset,
        "at": request.GET.get("at", ""),
        "error": _window_error(request),
        "windows": WINDOWS,
        "permalink": permalink,
        "report": f"{reverse('audit:timeline_report')}?{urlencode(fixed)}",
    }


def timeline(request: HttpRequest) -> HttpResponse:
    """What changed in a window, oldest first, with P99 charts of the models and nodes it
    touched, every change marked. The charts load as fragments: a slow Prometheus delays them,
    never the events."""
    context = _timeline_context(request)
    models, nodes = affected(context["events"])  # type: ignore[arg-type]
    if context["model"]:
        models = [str(context["model"]), *(m for m in models if m != context["model"])]
    window = cast(dict[str, str], context["fixed"])
    charts = [{"model": m} for m in models] + [{"node": n} for n in nodes]
    context["charts"] = [
        f"{reverse('audit:timeline_chart')}?{urlencode(window | chart)}"
        for chart in charts[:MAX_CHARTS] or [{}]  # nothing touched: the whole fleet
    ]
    context["more_charts"] = charts[MAX_CHARTS:]
    return render(request, "audit/timeline.html", context)


def timeline_chart(request: HttpRequest) -> HttpResponse:
    """One chart of a timeline window: a model's P99, or a node's P99 per model, or the fleet's."""
    start, end = _moment(request.GET.get("start", "")), _moment(request.GET.get("end", ""))
    model, node = request.GET.get("model", ""), request.GET.get("node", "")
    if start is None or end is None or end <= start:
        chart = Chart(title="P99 latency", message="The window needs a start before its end.")
    else:
        chart = metric_chart("p99", start=start, end=end, model=model, node=node)
    subject = f"model {model}" if model else f"node {node}" if node else "the fleet"
    chart = dataclasses.replace(chart, title=f"{chart.title}: {subject}")
    figure_id = "figure-" + slugify(f"{model or '-'} {node or '-'}")
    return render(request, "partials/chart.html", {"chart": chart, "id": figure_id})


def timeline_report(request: HttpRequest) -> HttpResponse:
    """The same window as Markdown, ready to paste into a postmortem."""
    context = _timeline_context(request)
    context["cells"] = [  # one line each, and no stray "|" to break the table
        {
            key: " ".join(str(value).split()).replace("|", "\\|")
            for key, value in _row(event).items()
        }
        for event in context["events"]  # type: ignore[attr-defined]
    ]
    text = render_to_string("audit/timeline_report.md", context, request)
    response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="incident-timeline.md"'
    return response
