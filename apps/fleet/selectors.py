from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from weakref import WeakKeyDictionary

from django.core.paginator import Paginator
from django.db.models import (
    BooleanField,
    Count,
    Exists,
    ExpressionWrapper,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Window,
)
from django.db.models.functions import Coalesce, RowNumber
from django.utils import timezone

from apps.fleet.desired import DesiredStateError, FleetDesired, fleet_desired, node_desired
from apps.fleet.models import Deployment, Node, NodePool, Operation, PoolOwner
from apps.fleet.owners import owners_live
from apps.fleet.triton import ready_in


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


# Nodes of one pool, in one stage and health, whose index, owned models and balancer weights
# are the same, listed by discovery or not, drift alike: every node of a converged pool is one
# shape. Fields, and what the database computes to group by and to match on alike.
_COMPUTED = {
    "served": Coalesce("served_weight", -1),  # the balancer's weight; equal to itself unknown
    "unlisted": ExpressionWrapper(Q(unlisted_since__isnull=False), output_field=BooleanField()),
}
_ALIKE = ("pool_id", "pool__traffic", "stage", "health", "weight", "draining", *_COMPUTED)
_ALIKE += ("index_key", "owned_key")  # the documents' hashes


@dataclass(frozen=True)
class Shape:
    """Nodes alike (`_ALIKE`): the pages count, filter and summarise shapes, so that 50,000
    nodes cost what 5 do; only the nodes of a page are read whole."""

    row: NodeRow  # of a representative, built from the shape's fields
    count: int
    first: int  # its first node; a group's may have deployments of its own, its fields alike
    alone: bool = False  # a node with deployments of its own (`first`), a shape by itself


# Rows of shapes, kept with the desired state they were computed against: while no deployment
# changes (`fleet_desired` hands out the same FleetDesired), a page shown again computes no row
# and reads no document of a shape it has seen. A shape's fields, the documents' hashes among
# them, are all its row is made of.
_ROWS: "WeakKeyDictionary[FleetDesired, dict[tuple, NodeRow]]" = WeakKeyDictionary()


def node_shapes(nodes: QuerySet[Node], desired: FleetDesired) -> list[Shape]:
    """The shapes of `nodes`, in three queries however many nodes: the groups (counted, which
    PostgreSQL hashes in one pass), the nodes with deployments of their own (a canary: a shape
    alone), then the documents of each shape not seen before (none, when a page is shown again
    and nothing changed)."""
    rows = _ROWS.setdefault(desired, {})
    nodes = nodes.order_by().annotate(**_COMPUTED)
    grouped = nodes.values(*_ALIKE).annotate(count=Count("pk"), first=Min("pk"))
    groups = {tuple(group[name] for name in _ALIKE): group for group in grouped}
    own = nodes.filter(pk__in=desired.overridden).values_list(*_ALIKE, "pk")
    alone = []  # the nodes with deployments of their own: their fields, and their id
    for *fields, pk in own:
        if group := groups.get(tuple(fields)):  # else changed since it was grouped
            group["count"] -= 1
            alone.append((tuple(fields), pk))
    # The rows needed, each by its key: its fields, and its node where it is alone.
    needed = {key: (key, None) for key, group in groups.items() if group["count"]}
    needed |= {(fields, pk): (fields, pk) for fields, pk in alone}
    if unseen := {key: made for key, made in needed.items() if key not in rows}:
        # A group's nodes have the same documents: its first one's make each of its rows.
        firsts = {groups[fields]["first"] for fields, _ in unseen.values()}
        read = Node.objects.filter(pk__in=firsts).values_list("pk", "index", "owned")
        documents = {pk: (index, owned) for pk, index, owned in read}
        for key, (fields, pk) in unseen.items():
            if found := documents.get(groups[fields]["first"]):  # else deleted since grouped
                rows[key] = node_row(_alike(fields, pk, *found), desired)
    shapes = [
        Shape(rows[key], group["count"], group["first"])
        for key, group in groups.items()
        if group["count"] and key in rows
    ]
    return shapes + [Shape(rows[f, pk], 1, pk, alone=True) for f, pk in alone if (f, pk) in rows]


def _alike(fields: tuple, pk: int | None, index: list, owned: list) -> Node:
    """A node of a shape's row: the shape's fields and documents; the node's id where it has
    deployments of its own."""
    values = dict(zip(_ALIKE, fields, strict=True))
    return Node(
        pk=pk,
        pool=NodePool(pk=values["pool_id"], traffic=values["pool__traffic"]),
        stage=values["stage"],
        health=values["health"],
        weight=values["weight"],
        served_weight=None if values["served"] == -1 else values["served"],
        draining=values["draining"],
        unlisted_since=timezone.now() if values["unlisted"] else None,
        index=index,
        owned=owned,
    )


def shapes_nodes(
    nodes: QuerySet[Node], shapes: list[Shape], desired: FleetDesired
) -> QuerySet[Node]:
    """The nodes of `shapes` among `nodes`: those alike a shape's first node (one hash join,
    however many shapes and nodes) that have no deployment of their own, and those alone."""
    firsts = [shape.first for shape in shapes if not shape.alone]
    alike = Node.objects.filter(pk__in=firsts).alias(**_COMPUTED)
    # The same pool, the same traffic strategy: the pool's is not compared again.
    alike = alike.filter(**{name: OuterRef(name) for name in _ALIKE if name != "pool__traffic"})
    found = Q(Exists(alike)) & ~Q(pk__in=desired.overridden)
    alone = Q(pk__in=[shape.first for shape in shapes if shape.alone])
    return nodes.alias(**_COMPUTED).filter(found | alone)


def nodes_serving(model: str, version: int | None) -> QuerySet[Node]:
    """The nodes whose last index shows `model` at `version` READY, found among the distinct
    indexes (one query, however many nodes share each) rather than read node by node."""
    firsts = Node.objects.order_by().values("index_key").annotate(first=Min("pk")).values("first")
    distinct = Node.objects.filter(pk__in=firsts).values_list("pk", "index")
    serving = [pk for pk, index in distinct if version in ready_in(index).get(model, set())]
    # Their keys as the database has them (on SQLite, the document itself, not a number).
    return node_list().filter(index_key__in=Node.objects.filter(pk__in=serving).values("index_key"))


def node_row(node: Node, desired: FleetDesired) -> NodeRow:
    models = node_models(node, desired)
    drift = drift_of(models)
    if node.traffic_drift:
        drift.append(node.traffic_drift)
    wanted = [row for row in models if row.desired]
    return NodeRow(node, drift, (sum(not row.drift for row in wanted), len(wanted)))


@dataclass(frozen=True)
class NodeSearch:
    """The nodes that pass some filters: their shapes, to count, and a query for a page."""

    shapes: list[Shape]
    nodes: QuerySet[Node]  # in the pages' order
    desired: FleetDesired

    @cached_property
    def summary(self) -> "FleetSummary":
        return fleet_summary(self.shapes)

    def rows(self, nodes: Iterable[Node]) -> list[NodeRow]:
        """A page's rows: its nodes as read for it."""
        return [node_row(node, self.desired) for node in nodes]

    def paginator(self, per_page: int) -> Paginator:
        """Pages of the nodes, counted by their shapes: a page is one query, not two."""
        return _Counted(self.nodes, per_page, sum(shape.count for shape in self.shapes))


class _Counted(Paginator):
    """A paginator told how many objects it pages (read moments before its page: a node that
    changed in between shows at the next refresh)."""

    def __init__(self, object_list: QuerySet, per_page: int, count: int) -> None:
        super().__init__(object_list, per_page)
        self.known = count

    @cached_property
    def count(self) -> int:
        return self.known


def node_search(filters: NodeFilters = NodeFilters()) -> NodeSearch:
    """The nodes that pass `filters`, in a handful of queries however many nodes."""
    nodes = node_list()
    pool_ids = None
    if filters.pool:
        nodes = nodes.filter(pool__name=filters.pool)
        pool_ids = list(NodePool.objects.filter(name=filters.pool).values_list("pk", flat=True))
    if filters.health:
        nodes = nodes.filter(health=filters.health)
    if filters.stage:
        nodes = nodes.filter(stage=filters.stage)
    if filters.search:
        found = Q(name__icontains=filters.search) | Q(http_url__icontains=filters.search)
        nodes = nodes.filter(found)
    desired = fleet_desired(pool_ids=pool_ids)
    shapes = node_shapes(nodes, desired)
    if filters.model:
        shapes = [s for s in shapes if filters.model in s.row.node.ready_versions]
    if filters.drift:
        shapes = [s for s in shapes if s.row.drift]
    if filters.model or filters.drift:
        nodes = shapes_nodes(nodes, shapes, desired)
    return NodeSearch(shapes, nodes, desired)


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


def fleet_summary(shapes: Iterable[Shape]) -> FleetSummary:
    stages: Counter[str] = Counter()
    healths: Counter[str] = Counter()
    drifted = models_ready = 0
    for shape in shapes:
        node, n = shape.row.node, shape.count
        stages[node.stage] += n
        if node.stage != Node.Stage.DEPARTED:
            healths[node.health] += n
            drifted += n if shape.row.drift else 0
            models_ready += n * sum(len(v) for v in node.ready_versions.values())
    return FleetSummary(
        nodes=healths.total(),
        ready=healths[Node.Health.READY],
        unreachable=healths[Node.Health.UNREACHABLE],
        drifted=drifted,
        models_ready=models_ready,
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


def node_models(
    node: Node, desired: FleetDesired | None = None, readings: "Readings | None" = None
) -> list[ModelRow]:
    """What the node serves against what it should. Managed: what its desired state names, and
    what this product loaded there and has not unloaded yet (or a person adopted). READY by
    `readings` where given (`nodes_read`: an operation's read-back newer than the last poll)."""
    wanted = _wanted(node, desired)
    entries: dict[str, list[dict]] = {}
    for entry in node.index:
        entries.setdefault(entry["model"], []).append(entry)
    ready = dict(node.ready_versions)
    for name in (set(entries) | set(wanted)) if readings else ():
        versions, at = readings.get((node.pk, name), (None, None))  # type: ignore[union-attr]
        if versions is not None and at != node.last_seen:  # read back since the poll
            ready[name] = sorted(versions)
            entries[name] = [
                {"model": name, "version": str(v), "state": "READY"} for v in ready[name]
            ]
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


def _wanted(node: Node, desired: FleetDesired | None) -> dict[str, list[int]]:
    try:
        found = desired.of(node) if desired else node_desired(node)
    except DesiredStateError:
        return {}
    return {name: list(d.versions) for name, d in found.items()}


Reading = tuple[set[int], datetime | None]
Readings = dict[tuple[int, str], Reading]


def nodes_read(nodes: list[Node], desired: FleetDesired | None = None) -> Readings:
    """`observed_many` of every model the nodes' indexes list or their desired state names: a
    load's or a move back's read-back shows at once, not at the next poll. Three queries."""
    names = {e["model"] for node in nodes for e in node.index}
    names |= {name for node in nodes for name in _wanted(node, desired)}
    return observed_many(nodes, names)


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
    """Recent failed or unknown operations not since followed by a success on the same model.
    The recent ones are scanned as a few columns; only those shown are read whole (with their
    node's name, not its index)."""
    recent = Operation.objects.order_by("-finished_at", "-id")[:200]
    latest: dict[tuple[int, str], tuple[int, str]] = {}
    for pk, node_id, model, status in recent.values_list("pk", "node_id", "model_name", "status"):
        latest.setdefault((node_id, model), (pk, status))
    bad = [pk for pk, status in latest.values() if status in _FAILING][:limit]
    shown = Operation.objects.filter(pk__in=bad).select_related("node").only(*_SHOWN)
    by_pk = {op.pk: op for op in shown}
    return [by_pk[pk] for pk in bad if pk in by_pk]  # newest first


_FAILING = (Operation.Status.FAILED, Operation.Status.UNKNOWN)
_SHOWN = ("status", "kind", "model_name", "error", "node__name")


DRIFTING_SHOWN = 5


@dataclass(frozen=True)
class PoolView:
    pool: NodePool
    deployments: list[Deployment]
    shapes: list[Shape]
    drifting: list[NodeRow]  # the first few nodes that drift, for a glance; the nodes page has all
    owners: list[PoolOwner]  # who drives what it serves of a model now, besides the reconciler

    @cached_property
    def summary(self) -> FleetSummary:  # a page asks it several times per pool
        return fleet_summary(self.shapes)


def pool_views(
    pools: Iterable[NodePool], *, glance: bool = False, fleet: NodeSearch | None = None
) -> list[PoolView]:
    """Each pool with its deployments and its nodes' drift, in a bounded number of queries;
    with `glance`, the first few drifting nodes of each read whole (`PoolView.drifting`). The
    nodes' shapes are `fleet`'s where given (the whole fleet's, read already)."""
    pools = list(pools)
    if fleet is not None:
        desired, found = fleet.desired, fleet.shapes
    else:
        desired = fleet_desired(pool_ids=[pool.pk for pool in pools])
        found = node_shapes(Node.objects.filter(pool__in=pools), desired)
    shapes: dict[int, list[Shape]] = {pool.pk: [] for pool in pools}
    for shape in found:
        if shape.row.node.pool_id in shapes:
            shapes[shape.row.node.pool_id].append(shape)
    drifting: dict[int, list[NodeRow]] = {pool.pk: [] for pool in pools}
    if glance:
        drift = [
            shape
            for found in shapes.values()
            for shape in found
            if shape.row.drift and shape.row.node.stage != Node.Stage.DEPARTED
        ]
        rank = Window(RowNumber(), partition_by="pool_id", order_by="pk")
        first = shapes_nodes(node_list().filter(pool__in=pools), drift, desired)
        for node in first.annotate(rank=rank).filter(rank__lte=DRIFTING_SHOWN):
            drifting[node.pool_id].append(node_row(node, desired))
    deployments: dict[int, list[Deployment]] = {pool.pk: [] for pool in pools}
    for deployment in Deployment.objects.filter(pool__in=pools).select_related("model"):
        deployments[deployment.pool_id].append(deployment)  # type: ignore[index]
    owners: dict[int, list[PoolOwner]] = {pool.pk: [] for pool in pools}
    for owner in owners_live().filter(pool__in=pools).select_related("model"):
        owners[owner.pool_id].append(owner)
    return [
        PoolView(pool, deployments[pool.pk], shapes[pool.pk], drifting[pool.pk], owners[pool.pk])
        for pool in pools
    ]
