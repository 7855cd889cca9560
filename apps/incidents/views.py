"""Incident review: the timeline (what changed in a window, with P99 charts around it, as a page
and as a Markdown report), and incidents with their ranked suspects."""

import dataclasses
from datetime import datetime, timedelta
from typing import cast

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.utils.text import slugify
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.audit.models import AuditEvent
from apps.audit.views import event_row, utc_moment
from apps.incidents.models import Incident
from apps.incidents.services import (
    MANAGE,
    IncidentError,
    incident_open,
    incident_rollback,
    incident_update,
)
from apps.incidents.suspects import suspects
from apps.incidents.timeline import (
    MAX_EVENTS,
    MAX_WINDOW,
    affected,
    around,
    span_of,
    timeline_events,
    what_changed,
    window_valid,
)
from apps.observability.charts import Chart, metric_chart
from apps.web.htmx import back, refused

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
    events, more = timeline_events(start, end)
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
        "more": more
        and request.build_absolute_uri(
            f"{reverse('incidents:timeline')}?"
            # To the microsecond: a busy second may hold more than a page.
            + urlencode(fixed | {"start": f"{more:%Y-%m-%dT%H:%M:%S.%f}"})
        ),
        "max_events": MAX_EVENTS,
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
    # The timeline of its window is where it is shown: no link to itself.
    chart = dataclasses.replace(chart, title=f"{chart.title}: {subject}", window="")
    figure_id = "figure-" + slugify(f"{model or '-'} {node or '-'}")
    return render(request, "partials/chart.html", {"chart": chart, "id": figure_id})


def timeline_report(request: HttpRequest) -> HttpResponse:
    """The same window as Markdown, ready to paste into a postmortem."""
    context = _timeline_context(request)
    # As text: the template escapes each cell (apps/incidents/templatetags/mdtext.py).
    context["cells"] = [
        {key: str(value) for key, value in event_row(event).items()}
        for event in context["events"]  # type: ignore[attr-defined]
    ]
    text = render_to_string("incidents/timeline_report.md", context, request)
    response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="incident-timeline.md"'
    return response


INCIDENTS_PER_PAGE = 25


def incident_list(request: HttpRequest) -> HttpResponse:
    incidents = Incident.objects.select_related("owner", "pool", "model")
    page = Paginator(incidents, INCIDENTS_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "incidents/incident_list.html", {"incidents": page})


def _incident_context(incident: Incident) -> dict[str, object]:
    start, end = incident.window
    ranked, problem = suspects(incident)
    actions = AuditEvent.objects.filter(target=f"incident:{incident.pk}").order_by("created_at")
    window = {"start": f"{start:%Y-%m-%dT%H:%M:%S}", "end": f"{end:%Y-%m-%dT%H:%M:%S}"}
    shown = {"model": incident.model.name} if incident.model else {}
    return {
        "incident": incident,
        "suspects": ranked,
        "prometheus_problem": problem,
        "actions": actions,
        "timeline": f"{reverse('incidents:timeline')}?{urlencode(window | shown)}",
        "chart": f"{reverse('incidents:timeline_chart')}?{urlencode(_evidence(incident) | shown)}",
        "durations": _durations(incident),
    }


def _evidence(incident: Incident) -> dict[str, str]:
    """The evidence chart's window: a quarter of an hour before the onset, to now or the end."""
    start, end = incident.window
    return {
        "start": f"{start - timedelta(minutes=15):%Y-%m-%dT%H:%M:%S}",
        "end": f"{end + timedelta(seconds=1):%Y-%m-%dT%H:%M:%S}",
    }


def _durations(incident: Incident) -> list[tuple[str, str]]:
    """Time to detect (onset to opened), to mitigate and to resolve, from the onset."""
    marks = [
        ("detect", incident.opened_at),
        ("mitigate", incident.mitigated_at),
        ("resolve", incident.resolved_at),
    ]
    return [(name, _spent(at - incident.started_at) if at else "not yet") for name, at in marks]


def _spent(delta: timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def incident_detail(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident.objects.select_related("owner", "pool", "model"), pk=pk)
    return render(request, "incidents/incident_detail.html", _incident_context(incident))


def incident_report(request: HttpRequest, pk: int) -> HttpResponse:
    """The post-mortem's facts, in order: the incident, its ranked suspects with their evidence,
    what was done by whom and when, and the times to detect, mitigate and resolve."""
    incident = get_object_or_404(Incident.objects.select_related("owner", "pool", "model"), pk=pk)
    context = _incident_context(incident)
    context["link"] = request.build_absolute_uri(reverse("incidents:incident_detail", args=[pk]))
    text = render_to_string("incidents/incident_report.md", context, request)
    response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="incident-{pk}.md"'
    return response


@require_POST
@require(MANAGE, "incident.open")
def incident_open_view(request: HttpRequest) -> HttpResponse:
    """Open an incident over a window, from the timeline or a chart."""
    post = request.POST.get
    start, end = utc_moment(post("start", "")), utc_moment(post("end", ""))
    try:
        if start is None:
            raise IncidentError("start: expected a date and time such as 2026-11-29T14:05 (UTC)")
        incident = incident_open(
            title=post("title", ""),
            severity=post("severity", "warning"),
            start=start,
            end=end,
            model=post("model", ""),
            pool=post("pool", ""),
            actor=current_user(request),
        )
    except IncidentError as exc:
        return refused(request, str(exc), reverse("incidents:incident_list"), status=422)
    messages.success(request, f"Incident #{incident.pk} opened.")
    return back(request, reverse("incidents:incident_detail", args=[incident.pk]))


@require_POST
@require(MANAGE, "incident.update")
def incident_update_view(request: HttpRequest, pk: int) -> HttpResponse:
    here = reverse("incidents:incident_detail", args=[pk])
    post = request.POST
    try:
        incident_update(
            incident_id=pk,
            status=post.get("status", ""),
            owner=post.get("owner"),
            notes=post.get("notes"),
            actor=current_user(request),
        )
    except IncidentError as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"Incident #{pk} updated.")
    return back(request, here)


@require_POST
@require(MANAGE, "incident.rollback")
def incident_rollback_view(request: HttpRequest, pk: int) -> HttpResponse:
    """A suspect's one click: its rollout rolled back, or its pool to the last good release."""
    here = reverse("incidents:incident_detail", args=[pk])
    post = request.POST.get
    try:
        done = incident_rollback(
            incident_id=pk,
            model=post("model", ""),
            pool=post("pool", ""),
            rollout=_number(post("rollout", "")),
            actor=current_user(request),
        )
    except IncidentError as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"{done[:1].upper()}{done[1:]}.")
    return back(request, here)
