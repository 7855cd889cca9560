"""The incident timeline: what changed in a window, with P99 charts around it, as a page and
as a Markdown report."""

import dataclasses
from datetime import datetime, timedelta
from typing import cast

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.utils.text import slugify

from apps.audit.views import event_row, utc_moment
from apps.incidents.timeline import (
    MAX_WINDOW,
    affected,
    around,
    span_of,
    timeline_events,
    what_changed,
    window_valid,
)
from apps.observability.charts import Chart, metric_chart

MAX_CHARTS = 8
WINDOWS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}


def _window(request: HttpRequest) -> tuple[datetime, datetime, str, str, str]:
    """(start, end, model, title, preset): an absolute start and end (a permalink), a rollout's
    or an operation's span with five minutes either side, a preset around a given time, or a
    preset before now."""
    get = request.GET.get
    start_at, end_at = utc_moment(get("start", "")), utc_moment(get("end", ""))
    if start_at and end_at and window_valid(start_at, end_at):
        return start_at, end_at, get("model", ""), "", ""
    ran = span_of(rollout=_number(get("rollout", "")), operation=_number(get("operation", "")))
    if ran is not None:
        return *ran, ""
    preset = get("window", "1h") if get("window", "1h") in WINDOWS else "1h"
    at = utc_moment(get("at", ""))
    span = around(at, WINDOWS[preset]) if at else None
    if at and span:
        return *span, "", f"{preset} around {at:%Y-%m-%d %H:%M} UTC", preset
    end = timezone.now()
    return end - WINDOWS[preset], end, "", f"last {preset}", preset


def _window_error(request: HttpRequest) -> str:
    """What was wrong with the window asked for (the last hour is shown instead), or ""."""
    get = request.GET.get
    if get("start") or get("end"):
        start_at, end_at = utc_moment(get("start", "")), utc_moment(get("end", ""))
        if not (start_at and end_at and window_valid(start_at, end_at)):
            return (
                f"start, end: a start before the end, {MAX_WINDOW.days} days apart at most, "
                "such as 2026-11-29T14:05 (UTC)"
            )
    at = utc_moment(get("at", ""))
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
    permalink = request.build_absolute_uri(f"{reverse('incidents:timeline')}?{urlencode(fixed)}")
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
        "report": f"{reverse('incidents:timeline_report')}?{urlencode(fixed)}",
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
        f"{reverse('incidents:timeline_chart')}?{urlencode(window | chart)}"
        for chart in charts[:MAX_CHARTS] or [{}]  # nothing touched: the whole fleet
    ]
    context["more_charts"] = charts[MAX_CHARTS:]
    return render(request, "incidents/timeline.html", context)


def timeline_chart(request: HttpRequest) -> HttpResponse:
    """One chart of a timeline window: a model's P99, or a node's P99 per model, or the fleet's."""
    start, end = utc_moment(request.GET.get("start", "")), utc_moment(request.GET.get("end", ""))
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
            for key, value in event_row(event).items()
        }
        for event in context["events"]  # type: ignore[attr-defined]
    ]
    text = render_to_string("incidents/timeline_report.md", context, request)
    response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="incident-timeline.md"'
    return response
