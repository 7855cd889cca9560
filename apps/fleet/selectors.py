from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Max, Q, QuerySet

from apps.fleet.desired import DesiredStateError, FleetDesired, fleet_desired, node_desired
from apps.fleet.models import Deployment, Node, NodePool, Operation


def node_list() -> QuerySet[Node]:
    return Node.objects.select_related("pool")


@dataclass(frozen=True)
class NodeFilters:
    pool: str = ""
    health: str = ""
    stage: str = ""  # joining, serving, departed
    model: str = ""  # READY on the node
    drift: bool = False
    search: str = ""  # in the name or address

    @property
    def active(self) -> bool:
        return any((self.pool, self.health, self.stage, self.model, self.drift, self.search))


@dataclass(frozen=True)
class NodeRow:
    node: Node
    drift: list[str]
    serving: tuple[int, int] = (0, 0)  # models of its desired state it serves, of how many

    @property
    def progress(self) -> str:
        """Where a joining node is: how much of its pool's release it serves already."""
        done, wanted = self.serving
        return f"{done} of {wanted} models READY" if wanted else "nothing to load"


def node_rows(filters: NodeFilters = NodeFilters()) -> list[NodeRow]:
    """Every node that passes `filters`, with its drift: one query for the nodes and a handful
    for the desired state of their pools, however many nodes."""
    nodes = node_list()
    if filters.pool:
        nodes = nodes.filter(pool__name=filters.pool)
    if filters.health:
        nodes = nodes.filter(health=filters.health)
    if filters.stage:
        nodes = nodes.filter(stage=filters.stage)
    if filters.search:
        found = Q(name__icontains=filters.search) | Q(http_url__icontains=filters.search)
        nodes = nodes.filter(found)
    rows = node_rows_of(nodes)
    if filters.model:
        rows = [r for r in rows if filters.model in r.node.ready_versions]
    if filters.drift:
        rows = [r for r in rows if r.drift]
    return rows


def node_rows_of(nodes: QuerySet[Node]) -> list[NodeRow]:
    found = list(nodes)
    desired = fleet_desired(pool_ids={node.pool_id for node in found})
    rows = []
    for node in found:
        models = node_models(node, desired)
        drift = drift_of(models)
        if node.traffic_drift:
            drift.append(node.traffic_drift)
        wanted = [row for row in models if row.desired]
        serving = (sum(not row.drift for row in wanted), len(wanted))
        rows.append(NodeRow(node, drift, serving))
    return rows


def converged(ready: Iterable[int], wanted: Iterable[int] | None) -> bool:
    """What converged means on the pages and in the API alike: a node serves a model READY at
    exactly the versions its desired state names (`wanted`), no more and no fewer; never while
    that state cannot be resolved (None)."""
    return wanted is not None and set(ready) == set(wanted)


@dataclass(frozen=True)
class FleetSummary:
    nodes: int  # here: every count but `departed` is of the nodes that have not departed
    ready: int
    unreachable: int
    drifted: int
    models_ready: int
    joining: int = 0
    quarantined: int = 0
    departed: int = 0

    @property
    def converged_nodes(self) -> int:
        """Nodes that drift on no model."""
        return self.nodes - self.drifted


def fleet_summary(rows: list[NodeRow]) -> FleetSummary:
    stages = Counter(r.node.stage for r in rows)
    here = [r for r in rows if r.node.stage != Node.Stage.DEPARTED]
    return FleetSummary(
        nodes=len(here),
        ready=sum(r.node.health == Node.Health.READY for r in here),
        unreachable=sum(r.node.health == Node.Health.UNREACHABLE for r in here),
        drifted=sum(bool(r.drift) for r in here),
        models_ready=sum(len(v) for r in here for v in r.node.ready_versions.values()),
        joining=stages[Node.Stage.JOINING],
        quarantined=stages[Node.Stage.QUARANTINED],
        departed=stages[Node.Stage.DEPARTED],
    )


@dataclass(frozen=True)
class ModelRow:
    """One model on one node: what it serves, what it should serve, and whether we manage it."""

    model: str
    versions: list[dict]  # index entries: version, state, reason
    ready: list[int]
    desired: list[int]
    managed: bool

    @property
    def drift(self) -> bool:
        return self.managed and not converged(self.ready, self.desired)


def node_models(node: Node, desired: FleetDesired | None = None) -> list[ModelRow]:
    """What the node serves against what it should. Managed: what its desired state names, and
    what this product loaded there and has not unloaded yet (or a person adopted)."""
    try:
        wanted = {
            name: list(d.versions)
            for name, d in (desired.of(node) if desired else node_desired(node)).items()
        }
    except DesiredStateError:
        wanted = {}
    entries: dict[str, list[dict]] = {}
    for entry in node.index:
        entries.setdefault(entry["model"], []).append(entry)
    ready = node.ready_versions
    managed = set(wanted) | set(node.owned)
    return [
        ModelRow(
            model=name,
            versions=[e for e in entries.get(name, []) if e.get("version") or e.get("state")],
            ready=ready.get(name, []),
            desired=wanted.get(name, []),
            managed=name in managed,
        )
        for name in sorted(set(entries) | set(wanted))
    ]


Reading = tuple[set[int], datetime | None]


def observed_many(nodes: list[Node], models: Iterable[str]) -> dict[tuple[int, str], Reading]:
    """For each node and model: the versions READY by the newest reading, the last poll's index
    or the last operation's read-back, and since when that reading is known. Two queries,
    however many nodes and models."""
    names = set(models)
    succeeded = Operation.objects.filter(
        node__in=nodes, model_name__in=names, status=Operation.Status.SUCCEEDED
    )
    newest = succeeded.values("node_id", "model_name").annotate(at=Max("finished_at"))
    moments = {(row["node_id"], row["model_name"]): row["at"] for row in newest}
    last: dict[tuple[int, str], tuple[list[int], datetime]] = {}
    for op in succeeded.filter(finished_at__in={at for at in moments.values() if at}):
        key = (op.node_id, op.model_name)
        if moments.get(key) == op.finished_at:
            last[key] = (op.versions, op.finished_at)  # type: ignore[assignment]
    readings: dict[tuple[int, str], Reading] = {}
    for node in nodes:
        ready = node.ready_versions
        for name in names:
            polled = set(ready.get(name, []))
            versions, at = last.get((node.pk, name), (None, None))
            if versions is None or at is None:
                readings[(node.pk, name)] = (polled, node.last_seen)
            elif node.last_seen is None or at >= node.last_seen or set(versions) == polled:
                readings[(node.pk, name)] = (set(versions), at)
            else:
                readings[(node.pk, name)] = (polled, node.last_seen)
    return readings


def drift_of(rows: list[ModelRow]) -> list[str]:
    out = []
    for row in rows:
        if row.drift:
            out.append(f"{row.model}: READY {row.ready or 'none'}, desired {row.desired or 'none'}")
        elif not row.managed and row.ready:
            out.append(f"{row.model}: unmanaged (loaded by someone else), READY {row.ready}")
    return out


def failing_operations(limit: int = 10) -> list[Operation]:
    """Recent failed or unknown operations not since followed by a success on the same model."""
    recent = Operation.objects.select_related("node").order_by("-finished_at", "-id")[:200]
    latest: dict[tuple[int, str], Operation] = {}
    for op in recent:
        latest.setdefault((op.node_id, op.model_name), op)
    bad = [
        op
        for op in latest.values()
        if op.status in (Operation.Status.FAILED, Operation.Status.UNKNOWN)
    ]
    return bad[:limit]


@dataclass(frozen=True)
class PoolView:
    pool: NodePool
    deployments: list[Deployment]
    rows: list[NodeRow]

    @property
    def summary(self) -> FleetSummary:
        return fleet_summary(self.rows)

    @property
    def drifting(self) -> list[NodeRow]:
        """The first few nodes that drift, for a glance; the nodes page lists them all."""
        return [row for row in self.rows if row.drift][:5]


def pool_views(pools: Iterable[NodePool]) -> list[PoolView]:
    """Each pool with its deployments and its nodes' drift, in a bounded number of queries."""
    pools = list(pools)
    rows: dict[int, list[NodeRow]] = {pool.pk: [] for pool in pools}
    for row in node_rows_of(node_list().filter(pool__in=pools)):
        rows[row.node.pool_id].append(row)
    deployments: dict[int, list[Deployment]] = {pool.pk: [] for pool in pools}
    for deployment in Deployment.objects.filter(pool__in=pools).select_related("model"):
        deployments[deployment.pool_id].append(deployment)  # type: ignore[index]
    return [PoolView(pool, deployments[pool.pk], rows[pool.pk]) for pool in pools]
