from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any
from weakref import WeakKeyDictionary

from django.db.models import (
    Aggregate,
    Max,
    Q,
    QuerySet,
    TextField,
)

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


class _Ids(Aggregate):
    """A group's primary keys, comma-separated: STRING_AGG on PostgreSQL, GROUP_CONCAT on
    SQLite."""

    function = "STRING_AGG"
    template = "%(function)s(CAST(%(expressions)s AS text), ',')"
    output_field = TextField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        template = "GROUP_CONCAT(%(expressions)s)"
        return self.as_sql(compiler, connection, template=template, **extra)


# Nodes of one pool, in one stage and health, whose index, owned models and balancer weights
# are the same drift alike: every node of a converged pool is one shape.
_ALIKE = ("pool_id", "pool__traffic", "stage", "health", "weight", "served_weight", "draining")


@dataclass(frozen=True)
class Shape:
    """Nodes alike (`_ALIKE`): the pages count, filter and summarise shapes, so that 5,000 nodes
    cost what 5 do; only the nodes of a page are read whole."""

    row: NodeRow  # of a representative, built from the shape's fields
    ids: list[int]


# Rows of shapes, kept with the desired state they were computed against: while no deployment
# changes (`fleet_desired` hands out the same FleetDesired), a page shown again computes no row
# and reads no document of a shape it has seen. A shape's fields, the documents' hashes among
# them, are all its row is made of.
_ROWS: "WeakKeyDictionary[FleetDesired, dict[tuple, NodeRow]]" = WeakKeyDictionary()


def node_shapes(nodes: QuerySet[Node], desired: FleetDesired) -> list[Shape]:
    """The shapes of `nodes`, in two queries however many nodes: the groups, then one node's
    index and owned models for each shape not seen before (none, when a page is shown again and
    nothing changed). A node with deployments of its own (a canary) is a shape alone."""
    alike = (*_ALIKE, "index_key", "owned_key")  # the documents' hashes last
    own, rows = desired.overridden, _ROWS.setdefault(desired, {})
    groups = []  # each group's fields, its nodes, and the rows it needs
    for group in nodes.order_by().values(*alike).annotate(ids=_Ids("pk")):
        key, ids = tuple(group[name] for name in alike), sorted(map(int, group["ids"].split(",")))
        groups.append((key, ids, _keys(key, ids, own)))
    unseen = {ids[0]: (key, needed) for key, ids, needed in groups if _missing(needed, rows)}
    if unseen:
        firsts = Node.objects.filter(pk__in=unseen).values_list("pk", "index", "owned")
        for pk, index, owned in firsts:
            key, needed = unseen[pk]
            fields: dict[str, Any] = dict(zip(_ALIKE, key, strict=False))
            fields |= {"index": index, "owned": owned}
            pool = NodePool(pk=fields.pop("pool_id"), traffic=fields.pop("pool__traffic"))
            for k in needed:
                node = Node(pool=pool, **fields) if k == key else Node(pk=k[1], pool=pool, **fields)
                rows[k] = node_row(node, desired)
    shapes = []
    for key, ids, needed in groups:
        if _missing(needed, rows):
            continue  # deleted since it was grouped: gone from the page at its next refresh
        if others := [pk for pk in ids if pk not in own]:
            shapes.append(Shape(rows[key], others))
        shapes += [Shape(rows[(key, pk)], [pk]) for pk in ids if pk in own]
    return shapes


def _missing(needed: set[tuple], rows: dict[tuple, NodeRow]) -> bool:
    """Whether a row `needed` is not computed yet: each looked up, as many lookups as the group
    needs (a set less `rows.keys()` copies every row of the fleet, for every group)."""
    return any(key not in rows for key in needed)


def _keys(key: tuple, ids: list[int], own: set[int]) -> set[tuple]:
    """The rows a group needs: one for its nodes alike, one for each node with its own state."""
    mine = {(key, pk) for pk in ids if pk in own}
    return mine | {key} if len(mine) < len(ids) else mine


def nodes_serving(model: str, version: int | None) -> QuerySet[Node]:
    """The nodes whose last index shows `model` at `version` READY, found among the distinct
    indexes (one query, however many nodes share each) rather than read node by node."""
    ids = [
        int(pk)
        for group in Node.objects.order_by().values("index").annotate(ids=_Ids("pk"))
        if version in ready_in(group["index"]).get(model, set())
        for pk in group["ids"].split(",")
    ]
    return node_list().filter(pk__in=ids)


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
        nodes = nodes.filter(pk__in=[pk for shape in shapes for pk in shape.ids])
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
        node, n = shape.row.node, len(shape.ids)
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


def pool_views(pools: Iterable[NodePool], *, glance: bool = False) -> list[PoolView]:
    """Each pool with its deployments and its nodes' drift, in a bounded number of queries;
    with `glance`, the first few drifting nodes of each read whole (`PoolView.drifting`)."""
    pools = list(pools)
    desired = fleet_desired(pool_ids=[pool.pk for pool in pools])
    shapes: dict[int, list[Shape]] = {pool.pk: [] for pool in pools}
    for shape in node_shapes(Node.objects.filter(pool__in=pools), desired):
        shapes[shape.row.node.pool_id].append(shape)
    drifting: dict[int, list[NodeRow]] = {pool.pk: [] for pool in pools}
    if glance:
        first = []
        for found in shapes.values():
            ids = (
                pk
                for shape in found
                if shape.row.drift and shape.row.node.stage != Node.Stage.DEPARTED
                for pk in shape.ids
            )
            first += sorted(ids)[:DRIFTING_SHOWN]
        for node in node_list().filter(pk__in=first):
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
