"""What a pool's request rate needs, from what its releases were measured to serve: a part of
the pool's capacity page, loaded after it (Prometheus may take its time)."""

from dataclasses import dataclass

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from apps.fleet.models import Deployment, NodePool
from apps.performance.selectors import Capacity, capacities
from apps.prometheus.catalog import CAPACITY_WINDOW, pool_rates_query
from apps.prometheus.client import PrometheusUnavailable, instant_query


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
