"""Reads of the measurements: what one node serves of a version within its budget (its
capacity, as perf_analyzer measured it), and what a pool's request rate needs of it."""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Max, Q

from apps.performance.models import PerfRun


@dataclass(frozen=True)
class Capacity:
    """A version's newest measurement, read at the model's latency budget."""

    model: str
    version: int
    per_node: float | None  # requests a second at the best concurrency within the budget
    concurrency: int | None
    p99_ms: float | None
    budget_ms: int | None  # none: the best concurrency measured
    run: int
    node: str
    measured_at: datetime | None

    def nodes_for(self, rate: float) -> int | None:
        """The nodes `rate` requests a second need at this capacity; none when not measured
        within the budget."""
        if not self.per_node:
            return None
        return max(1, math.ceil(rate / self.per_node)) if rate > 0 else 0


def capacities(pairs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Capacity]:
    """Each (model, version)'s capacity from its newest finished measurement, on whatever node
    and for whatever purpose it ran: three queries, however many versions and runs."""
    query = Q()
    for name, version in set(pairs):
        query |= Q(model__name=name, version=version)
    if not query:
        return {}
    done = PerfRun.objects.filter(query, status=PerfRun.Status.DONE)
    newest = done.values("model_id", "version").annotate(newest=Max("id")).values("newest")
    runs = PerfRun.objects.filter(pk__in=newest).select_related("model").prefetch_related("points")
    return {(run.model.name, run.version): _capacity(run) for run in runs}


def _capacity(run: PerfRun) -> Capacity:
    budget = run.model.latency_budget_ms
    within = [p for p in run.points.all() if budget is None or p.p99_ms <= budget]
    best = max(within, key=lambda p: p.throughput, default=None)
    return Capacity(
        model=run.model.name,
        version=run.version,
        per_node=best.throughput if best else None,
        concurrency=best.concurrency if best else None,
        p99_ms=best.p99_ms if best else None,
        budget_ms=budget,
        run=run.pk,
        node=run.node_name,
        measured_at=run.finished_at,
    )
