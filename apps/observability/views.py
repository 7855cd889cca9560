import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone

from apps.fleet.models import Deployment, NodePool
from apps.observability import bottleneck as pipeline
from apps.observability.breakdown import serving_version, step_breakdown, worst_p99_ms
from apps.observability.charts import Chart, metric_chart
from apps.observability.llm import fits, llm_steps
from apps.observability.tiles import fleet_tiles
from apps.prometheus.catalog import METRICS
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.codec import step_names
from apps.registry.ensembles import UnresolvedStep
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import stored_steps
from apps.web.htmx import HtmxHttpRequest

RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}


MAX_SPAN = timedelta(days=30)
# Measured on Triton 2.51: an ensemble's own series say version="1" whatever version served.
ENSEMBLE_VERSIONS = (
    "Triton labels an ensemble's own series version 1 whatever version served the request: "
    "compare a canary here by node (P99 latency per node), or by its steps' versions."
)
REFRESH_S = 15


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
    chosen model, pool or node drawn as a marker."""
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
        "refresh": request.GET.get("refresh") == "on",
        "refresh_s": REFRESH_S,
    }
    if not request.htmx:
        # The filters' choices: only the whole page shows them, the chart fragment does not. A
        # node is typed, not chosen: 5,000 options would be the page's weight.
        context["models"] = Model.objects.values_list("name", flat=True)
        context["pools"] = NodePool.objects.values_list("name", flat=True)
        return render(request, "observability/metrics.html", context)
    window = chart_window(request.GET.dict())
    if isinstance(window, str):
        context["chart"] = Chart(title=METRICS[metric].title, message=window)
    else:
        start, end = window
        chart = metric_chart(metric, start=start, end=end, model=model, pool=pool, node=node)
        by_version = "version" in METRICS[metric].template
        if by_version and model and Model.objects.filter(name=model, kind="ensemble").exists():
            chart = dataclasses.replace(chart, note=ENSEMBLE_VERSIONS)
        context["chart"] = chart
    return render(request, "observability/metrics.html#chart", context)


def tiles(request: HttpRequest) -> HttpResponse:
    """The overview's live tiles (a fragment the overview polls)."""
    try:
        context: dict[str, object] = {"tiles": fleet_tiles()}
    except PrometheusUnavailable as exc:
        context = {"error": str(exc)}
    return render(request, "observability/partials/tiles.html", context)


def breakdown(request: HttpRequest, name: str) -> HttpResponse:
    """The serving version's step P99s against their budgets (a fragment for the model page)."""
    versions = {v.version: v for v in ModelVersion.objects.filter(model__name=name)}
    context: dict[str, object] = {}
    try:
        models = sorted({name}.union(*(step_names(v.config) for v in versions.values())))
        p99 = worst_p99_ms(models)
    except PrometheusUnavailable as exc:
        return render(request, "observability/partials/breakdown.html", {"error": str(exc)})
    pins = ((v, set(_pinned(versions[v]))) for v in sorted(versions, reverse=True))
    number = serving_version(p99, name, pins) or max(versions, default=None)
    if number is None:
        return render(
            request, "observability/partials/breakdown.html", {"error": f"{name} has no version"}
        )
    budgets = dict(Model.objects.filter(name__in=models).values_list("name", "latency_budget_ms"))
    try:
        configs = stored_steps(versions[number].config)
    except UnresolvedStep as exc:
        error = f"{name} v{number}: {exc}"
        return render(request, "observability/partials/breakdown.html", {"error": error})
    split = {fit.model: fit for fit in fits(llm_steps(configs, budgets))}
    context["version"] = number
    context["rows"] = step_breakdown((name, number), list(configs), budgets, p99, split)
    return render(request, "observability/partials/breakdown.html", context)


def _pinned(version: ModelVersion) -> dict[tuple[str, int], Any]:
    try:
        return stored_steps(version.config)
    except UnresolvedStep:
        return {}


def bottleneck(request: HttpRequest, name: str) -> HttpResponse:
    """Where an ensemble's time goes in a pool (its deployment's version there, else its newest
    published one), from its steps' counters, and what to change about the slowest step."""
    ensemble = get_object_or_404(Model, name=name, kind=Model.Kind.ENSEMBLE)
    deployed = Deployment.objects.filter(model=ensemble, pool__isnull=False).select_related("pool")
    pools = list(NodePool.objects.order_by("name").values_list("name", flat=True))
    first = deployed.order_by("pool__name").first()
    pool = request.GET.get("pool") or (first.pool.name if first and first.pool else "")
    context: dict[str, object] = {
        "model": ensemble,
        "pools": pools,
        "pool": pool,
        "window_min": pipeline.WINDOW_S // 60,
    }
    if pool not in pools:
        context["error"] = f"No pool named {pool!r}." if pool else "There is no pool yet."
        return render(
            request, "observability/bottleneck.html", context, status=404 if pool else 200
        )
    try:
        context["version"], context["found"] = pipeline.bottleneck_in(ensemble, pool)
    except pipeline.BottleneckUnread as exc:
        context["error"] = str(exc)
    return render(request, "observability/bottleneck.html", context)
