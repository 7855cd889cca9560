"""What the signal reads: each pool's nodes, what Prometheus says of it, what runs on it; and
which nodes a scale-in should take first. A fixed number of queries for every pool at once:
a tick costs the same at 5 pools as at 500."""

from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Case, Count, Q, QuerySet, Value, When

from apps.degradation.models import Tiers
from apps.fleet.models import Deployment, Node, NodePool
from apps.performance.search import searches_holding
from apps.performance.selectors import capacities
from apps.prometheus.catalog import scaling_query
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from apps.scaling.models import Scaling
from apps.scaling.signal import Load, Reading

IN_TRAFFIC = Q(stage=Node.Stage.SERVING, draining=False, unlisted_since__isnull=True, weight__gt=0)


def node_counts(pools: QuerySet[NodePool] | None = None) -> dict[int, tuple[int, int]]:
    """Each pool's nodes (those that have not departed) and, of them, those in traffic."""
    nodes = Node.objects.exclude(stage=Node.Stage.DEPARTED)
    if pools is not None:
        nodes = nodes.filter(pool__in=pools)
    rows = (
        nodes.order_by()
        .values_list("pool_id")
        .annotate(nodes=Count("pk"), serving=Count("pk", filter=IN_TRAFFIC))
    )
    return {pool_id: (count, serving) for pool_id, count, serving in rows}


@dataclass(frozen=True)
class PoolScaling:
    """What the pool's page and the API show: its count and bounds (`scaling`), its nodes now,
    and the order a scale-in takes them in."""

    scaling: Scaling
    nodes: int  # not departed
    serving: int  # of them, in traffic
    order: QuerySet[Node]  # `scale_in_order`

    @property
    def going(self) -> QuerySet[Node]:
        """The nodes a scale-in to the count wanted takes."""
        wanted = self.scaling.wanted
        return self.order[: max(self.nodes - wanted, 0) if wanted is not None else 0]


def pool_scaling(pool: NodePool) -> PoolScaling:
    scaling = Scaling.objects.filter(pool=pool).first() or Scaling(pool=pool)
    nodes, serving = node_counts(NodePool.objects.filter(pk=pool.pk)).get(pool.pk, (0, 0))
    return PoolScaling(scaling, nodes, serving, scale_in_order(pool))


def readings(pools: dict[int, str]) -> dict[int, Reading]:
    """What Prometheus read of each pool over SCALING_WINDOW_S: the rate of each release its
    deployments serve against that release's measured capacity, its worst step's queue ratio,
    its GPUs' utilization. Prometheus down: every pool's reading says so."""
    try:
        series = instant_query(scaling_query(int(settings.SCALING_WINDOW_S)))
    except PrometheusUnavailable as exc:
        return {pk: Reading(unavailable=str(exc)) for pk in pools}
    ids = {name: pk for pk, name in pools.items()}
    # (pool, model, version): requests, queue us and compute us a second
    steps: dict[tuple[int, str, str], dict[str, float]] = defaultdict(dict)
    gpus: dict[int, float] = {}
    for labels, value in series:
        pk = ids.get(labels.get("pool", ""))
        if pk is None:
            continue
        if labels.get("measure") == "gpu":
            gpus[pk] = value
        else:
            key = (pk, labels.get("model", ""), labels.get("version", ""))
            steps[key][labels.get("measure", "")] = value
    rates: dict[tuple[int, str], float] = defaultdict(float)
    for (pk, model, _), measures in steps.items():
        rates[pk, model] += measures.get("rate", 0.0)
    loads, queues = _loads(pools, rates), _queues(steps)
    return {
        pk: Reading(loads=loads[pk], queue=queues.get(pk), gpu=gpus.get(pk))
        if pk in loads or pk in queues
        else Reading()
        for pk in pools
    }


def _loads(pools: dict[int, str], rates: dict[tuple[int, str], float]) -> dict[int, list[Load]]:
    """Each pool's served releases: their request rates and measured capacities."""
    served = list(
        Deployment.objects.filter(pool_id__in=pools, node__isnull=True)
        .order_by("model__name")
        .values_list("pool_id", "model__name", "version")
    )
    measured = capacities((name, version) for _, name, version in served)
    loads: dict[int, list[Load]] = defaultdict(list)
    for pk, name, version in served:
        if (pk, name) not in rates:
            continue
        capacity = measured.get((name, version))
        loads[pk].append(
            Load(
                release=f"{name} v{version}",
                rate=rates[pk, name],
                per_node=capacity.per_node if capacity else None,
                run=capacity.run if capacity else None,
            )
        )
    return loads


def _queues(steps: dict[tuple[int, str, str], dict[str, float]]) -> dict[int, tuple[str, float]]:
    """Each pool's worst step: its requests' time in queue beyond the batching delay its config
    asks for (at low load a request waits out the delay, by design), over their compute time.
    An ensemble is no step: its own series never queue."""
    names = {model for _, model, _ in steps}
    ensembles = set(
        Model.objects.filter(name__in=names, kind=Model.Kind.ENSEMBLE).values_list(
            "name", flat=True
        )
    )
    delays: dict[tuple[str, str], int] = {}
    for name, number, config in ModelVersion.objects.filter(model__name__in=names).values_list(
        "model__name", "version", "config"
    ):
        batching = (config or {}).get("dynamic_batching") or {}
        delays[name, str(number)] = int(batching.get("max_queue_delay_microseconds") or 0)
    waited: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (pk, model, version), measures in steps.items():
        if model in ensembles or "queue" not in measures:
            continue
        delay = delays.get((model, version), 0) * measures.get("rate", 0.0)
        sums = waited[pk, model]
        sums[0] += max(measures["queue"] - delay, 0.0)
        sums[1] += measures.get("compute", 0.0)
    worst: dict[int, tuple[str, float]] = {}
    for (pk, model), (queue, compute) in sorted(waited.items()):
        ratio = queue / max(compute, 1.0)  # as the recipe clamps it: 1 us a second at least
        if ratio > worst.get(pk, ("", -1.0))[1]:
            worst[pk] = (model, ratio)
    return worst


def holds() -> dict[int, list[str]]:
    """What runs on each pool that a scale-in would cut from under it: an active rollout (a
    canary, a blue-green switch, a performance gate), a degradation episode (a tier below the
    primary served), a search of a step's config on one of its nodes."""
    held: dict[int, list[str]] = defaultdict(list)
    rollouts = Rollout.objects.filter(state__in=Rollout.ACTIVE).order_by("pk")
    for pk, pool_id, model, version, strategy in rollouts.values_list(
        "pk", "pool_id", "model__name", "canary_version", "strategy"
    ):
        held[pool_id].append(f"rollout {pk} ({strategy}) of {model} v{version} runs")
    deployments = Deployment.objects.filter(node__isnull=True).order_by()
    served = {
        (pool_id, model_id): version
        for pool_id, model_id, version in deployments.values_list("pool_id", "model_id", "version")
    }
    for pool_id, model_id, model, versions in Tiers.objects.order_by("pk").values_list(
        "pool_id", "model_id", "model__name", "versions"
    ):
        degraded = served.get((pool_id, model_id))
        if degraded is not None and degraded != versions[0]:
            held[pool_id].append(f"{model} is degraded to v{degraded} (primary v{versions[0]})")
    searches = searches_holding().order_by("pk")
    for pk, pool_id, node in searches.values_list("pk", "node__pool_id", "node_name"):
        if pool_id is not None:
            held[pool_id].append(f"search {pk} holds {node} aside")
    return held


def scale_in_order(pool: NodePool) -> QuerySet[Node]:
    """The pool's nodes in the order a scale-in should take them: those already out of traffic
    first (drained, joining, quarantined), the newest first among equals; never a node an
    active rollout gave its canary or a search holds aside."""
    kept: set[str] = set()
    for names in Rollout.objects.filter(pool=pool, state__in=Rollout.ACTIVE).values_list(
        "canary_nodes", flat=True
    ):
        kept.update(names)
    kept.update(searches_holding().filter(node__pool=pool).values_list("node_name", flat=True))
    return (
        pool.nodes.exclude(stage=Node.Stage.DEPARTED)
        .exclude(name__in=kept)
        .annotate(serves=Case(When(IN_TRAFFIC, then=Value(1)), default=Value(0)))
        .order_by("serves", "-pk")
    )
