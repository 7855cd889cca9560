from datetime import timedelta

from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone

from apps.fleet.models import NodePool
from apps.observability.catalog import METRICS
from apps.observability.charts import metric_chart
from apps.registry.models import Model
from controlplane.htmx import HtmxHttpRequest

RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}


def metrics(request: HtmxHttpRequest) -> HttpResponse:
    """Metrics explorer; an htmx request gets only the chart (`#chart`)."""
    metric = request.GET.get("metric", "p99")
    metric = metric if metric in METRICS else "p99"
    span = request.GET.get("range", "15m")
    span = span if span in RANGES else "15m"
    model = request.GET.get("model", "")
    pool = request.GET.get("pool", "")
    end = timezone.now()
    context: dict[str, object] = {
        "metrics": METRICS.values(),
        "ranges": RANGES,
        "metric": metric,
        "span": span,
        "model": model,
        "pool": pool,
        "models": Model.objects.values_list("name", flat=True),
        "pools": NodePool.objects.values_list("name", flat=True),
    }
    if request.htmx:
        context["chart"] = metric_chart(
            metric, start=end - RANGES[span], end=end, model=model, pool=pool
        )
        return render(request, "observability/metrics.html#chart", context)
    return render(request, "observability/metrics.html", context)
