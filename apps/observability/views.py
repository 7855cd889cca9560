from datetime import UTC, datetime, timedelta

from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone

from apps.fleet.models import Node, NodePool
from apps.observability.catalog import METRICS
from apps.observability.charts import Chart, metric_chart
from apps.observability.markers import change_markers
from apps.registry.models import Model
from controlplane.htmx import HtmxHttpRequest

RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}


MAX_SPAN = timedelta(days=30)


def chart_window(params: dict[str, str]) -> tuple[datetime, datetime] | str:
    """The chart's time window from a preset or a custom start/end (UTC), or what is wrong."""
    end = timezone.now()
    span = params.get("range", "15m")
    if span != "custom":
        return end - RANGES.get(span, RANGES["15m"]), end
    try:
        start = datetime.fromisoformat(params.get("start", "")).replace(tzinfo=UTC)
        end = datetime.fromisoformat(params.get("end", "")).replace(tzinfo=UTC)
    except ValueError:
        return "A custom range needs a start and an end (YYYY-MM-DDTHH:MM, UTC)."
    if end <= start:
        return "The end of the range must come after its start."
    if end - start > MAX_SPAN:
        return f"A range can cover at most {MAX_SPAN.days} days."
    return start, end


def metrics(request: HtmxHttpRequest) -> HttpResponse:
    """Metrics explorer; an htmx request gets only the chart (`#chart`), with every change to the
    chosen model drawn as a marker."""
    metric = request.GET.get("metric", "p99")
    metric = metric if metric in METRICS else "p99"
    model = request.GET.get("model", "")
    pool = request.GET.get("pool", "")
    node = request.GET.get("node", "")
    context: dict[str, object] = {
        "metrics": METRICS.values(),
        "ranges": [*RANGES, "custom"],
        "metric": metric,
        "span": request.GET.get("range", "15m"),
        "start": request.GET.get("start", ""),
        "end": request.GET.get("end", ""),
        "model": model,
        "pool": pool,
        "node": node,
        "models": Model.objects.values_list("name", flat=True),
        "pools": NodePool.objects.values_list("name", flat=True),
        "nodes": Node.objects.values_list("name", flat=True),
    }
    if not request.htmx:
        return render(request, "observability/metrics.html", context)
    window = chart_window(request.GET.dict())
    if isinstance(window, str):
        context["chart"] = Chart(title=METRICS[metric].title, message=window)
    else:
        start, end = window
        markers = change_markers(start=start, end=end, model=model)
        context["chart"] = metric_chart(
            metric, start=start, end=end, model=model, pool=pool, node=node, markers=markers
        )
    return render(request, "observability/metrics.html#chart", context)
