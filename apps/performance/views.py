"""What a pool's request rate needs, from what its releases were measured to serve (a part of
the pool's capacity page, loaded after it: Prometheus may take its time), and a pipeline's
searches for the config of a step (apps/performance/search.py)."""

from dataclasses import dataclass
from typing import Any

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.permissions import authorize_audited, current_user, require
from apps.fleet.models import Deployment, NodePool
from apps.observability.charts import curves
from apps.performance.analyzer import SearchError
from apps.performance.forms import SearchForm
from apps.performance.models import PerfSearch
from apps.performance.selectors import Capacity, capacities
from apps.performance.services import search_start
from apps.prometheus.catalog import CAPACITY_WINDOW, pool_rates_query
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.codec import step_names
from apps.registry.models import Model
from apps.web.htmx import back, refused


@dataclass(frozen=True)
class Need:
    model: str
    version: int
    capacity: Capacity | None  # none: never measured
    rate: float | None  # requests a second now; none: Prometheus did not say
    nodes: int | None  # the nodes that rate needs at that capacity

    @property
    def unmeasured(self) -> str:
        """Why no node count, in words."""
        if self.capacity is None:
            return "not measured yet: a rollout's performance gate measures it"
        if self.capacity.per_node is None:
            return f"no concurrency measured within its {self.capacity.budget_ms} ms budget"
        return "request rate unknown"


def pool_throughput(request: HttpRequest, pool: str) -> HttpResponse:
    """Each release the pool serves: what a node serves of it within its budget, the pool's
    request rate now, and the nodes that rate needs."""
    found = get_object_or_404(NodePool, name=pool)
    deployed = Deployment.objects.filter(pool=found).select_related("model").order_by("model__name")
    pairs = [(d.model.name, d.version) for d in deployed]
    measured = capacities(pairs)
    message = ""
    try:
        rates = {
            labels.get("model", ""): value
            for labels, value in instant_query(pool_rates_query(found.name))
        }
    except PrometheusUnavailable as exc:
        rates, message = {}, f"The request rate is unknown: {exc}"
    rows = []
    for name, version in pairs:
        capacity, rate = measured.get((name, version)), rates.get(name)
        nodes = capacity.nodes_for(rate) if capacity and rate is not None else None
        rows.append(Need(name, version, capacity, rate, nodes))
    context = {
        "pool": found,
        "rows": rows,
        "serving": found.nodes.serving().count(),
        "window": CAPACITY_WINDOW,
        "message": message,
    }
    return render(request, "performance/pool_throughput.html", context)


def search_list(request: HttpRequest, name: str) -> HttpResponse:
    """A pipeline's searches, newest first, and the form that starts one."""
    return _search_list(request, get_object_or_404(Model, name=name, kind=Model.Kind.ENSEMBLE))


def _search_list(
    request: HttpRequest, pipeline: Model, form: SearchForm | None = None, status: int = 200
) -> HttpResponse:
    searches = PerfSearch.objects.filter(pipeline=pipeline).select_related("winner")
    context = {
        "pipeline": pipeline,
        "page": Paginator(searches, 25).get_page(request.GET.get("page")),
        "form": form or _search_form(pipeline),
    }
    return render(request, "performance/search_list.html", context, status=status)


def _search_form(pipeline: Model, data: Any = None) -> SearchForm:
    """Its pools: those that run the pipeline; its steps: those of the versions they run."""
    deployed = Deployment.objects.filter(model=pipeline, node=None).values_list(
        "pool__name", "version"
    )
    served = {version for _, version in deployed}
    configs = pipeline.versions.filter(version__in=served).values_list("config", flat=True)
    return SearchForm(
        data,
        pools=sorted({pool for pool, _ in deployed}),
        steps=sorted(set().union(*(step_names(config) for config in configs))),
    )


@require_POST
@require("performance.add_perfrun", "perf.search")
def search_new(request: HttpRequest, name: str) -> HttpResponse:
    pipeline = get_object_or_404(Model, name=name, kind=Model.Kind.ENSEMBLE)
    where = NodePool.objects.filter(name=request.POST.get("pool", "")).first()
    if where is not None:  # before the form is checked against what the pool runs
        authorize_audited(current_user(request), "performance.add_perfrun", where, "perf.search")
    form = _search_form(pipeline, request.POST)
    if not form.is_valid():
        return _search_list(request, pipeline, form, status=422)
    try:
        asked = form.cleaned_data
        search = search_start(
            pipeline=name,
            pool_name=asked["pool"],
            step=asked["step"],
            concurrency=asked["concurrency"],
            requests=asked["requests"],
            actor=current_user(request),
        )
    except SearchError as exc:
        return refused(request, str(exc), reverse("performance:search_list", args=[name]))
    return back(request, reverse("performance:search_detail", args=[search.pk]))


def search_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """Each configuration tried, its throughput and P99 against the budget, and the winner,
    which a release manager ships as a tuning rollout."""
    search = get_object_or_404(PerfSearch.objects.select_related("pipeline", "winner"), pk=pk)
    trials = list(search.trials.all())
    measured = [t for t in trials if t.throughput is not None]
    lines = {
        "configurations, in the order tried": [(t.throughput, t.p99_ms, t.label) for t in measured]
    }
    if search.winner and search.winner.throughput is not None:
        lines["the winner"] = [(search.winner.throughput, search.winner.p99_ms, "")]
    if search.budget_ms and measured:
        widest = max(t.throughput for t in measured)  # type: ignore[type-var]
        lines["the budget"] = [(0, search.budget_ms, ""), (widest, search.budget_ms, "budget")]
    chart = curves(
        "P99 against requests a second, each configuration",
        lines,  # type: ignore[arg-type]
        x="requests/s",
        y="ms at P99",
        note=f"{search.pipeline.name} v{search.version} end to end, {search.concurrency} users",
    )
    first = trials[0] if trials else None
    gain = None
    if search.winner and first and search.winner.pk != first.pk and first.throughput:
        gain = search.winner.throughput / first.throughput - 1  # type: ignore[operator]
    context = {"search": search, "trials": trials, "chart": chart, "first": first, "gain": gain}
    return render(request, "performance/search_detail.html", context)
