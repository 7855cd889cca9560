from datetime import timedelta

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.selectors import audit_event_list
from apps.observability.charts import metric_chart

WINDOWS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}


def audit_list(request: HttpRequest) -> HttpResponse:
    filters = {key: request.GET.get(key, "").strip() for key in ("actor", "action", "target")}
    page = Paginator(audit_event_list(**filters), 50).get_page(request.GET.get("page"))
    return render(request, "audit/audit_list.html", {"page": page, "filters": filters})


def timeline(request: HttpRequest) -> HttpResponse:
    """What changed in a window, oldest first, over the fleet's P99 with every change marked."""
    window = request.GET.get("window", "1h")
    window = window if window in WINDOWS else "1h"
    end = timezone.now()
    start = end - WINDOWS[window]
    events = list(AuditEvent.objects.filter(created_at__gte=start).order_by("created_at", "id"))
    chart = metric_chart("p99", start=start, end=end)
    return render(
        request,
        "audit/timeline.html",
        {"events": events, "chart": chart, "window": window, "windows": WINDOWS},
    )
