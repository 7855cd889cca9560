from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet

from apps.fleet.desired import DesiredStateError, node_desired
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.registry.models import Model


def node_list() -> QuerySet[Node]:
    return Node.objects.select_related("pool")


@dataclass(frozen=True)
class FleetSummary:
    nodes: int
    ready: int
    unreachable: int
    models_ready: int


def fleet_summary(nodes: list[Node]) -> FleetSummary:
    return FleetSummary(
        nodes=len(nodes),
        ready=sum(node.health == Node.Health.READY for node in nodes),
        unreachable=sum(node.health == Node.Health.UNREACHABLE for node in nodes),
        models_ready=sum(len(node.ready_models) for node in nodes),
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
        return self.managed and self.ready != self.desired


def node_models(node: Node) -> list[ModelRow]:
    try:
        desired = {name: list(d.versions) for name, d in node_desired(node).items()}
    except DesiredStateError:
        desired = {}
    managed = set(Model.objects.values_list("name", flat=True))
    entries: dict[str, list[dict]] = {}
    for entry in node.index:
        entries.setdefault(entry["model"], []).append(entry)
    names = sorted(set(entries) | set(desired))
    return [
        ModelRow(
            model=name,
            versions=[e for e in entries.get(name, []) if e.get("version") or e.get("state")],
            ready=ready_versions(node, name),
            desired=desired.get(name, []),
            managed=name in managed,
        )
        for name in names
    ]


def ready_versions(node: Node, model: str) -> list[int]:
    """The versions of `model` READY in the node's last polled repository index."""
    entries = [e for e in node.index if e["model"] == model and e.get("version")]
    return sorted(int(e["version"]) for e in entries if e.get("state") == "READY")


def observed_versions(node: Node, model: str) -> tuple[set[int], datetime | None]:
    """The versions of `model` READY on `node` by the newest reading, the last poll's index or
    the last operation's read-back, and since when that reading is known."""
    polled = set(ready_versions(node, model))
    op = (
        node.operations.filter(model_name=model, status=Operation.Status.SUCCEEDED)
        .order_by("-finished_at")
        .first()
    )
    if op is None or op.finished_at is None:
        return polled, node.last_seen
    if node.last_seen is None or op.finished_at >= node.last_seen or set(op.versions) == polled:
        return set(op.versions), op.finished_at
    return polled, node.last_seen


def node_drift(node: Node) -> list[str]:
    """Human-readable differences between what the node serves and what it should."""
    return drift_of(node_models(node))


def drift_of(rows: list[ModelRow]) -> list[str]:
    out = []
    for row in rows:
        if row.drift:
            out.append(f"{row.model}: READY {row.ready or 'none'}, desired {row.desired or 'none'}")
        elif not row.managed and row.ready:
            out.append(f"{row.model}: unmanaged (not in the registry), READY {row.ready}")
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
    nodes: list[tuple[Node, list[str]]]  # each node with its drift

    @property
    def converged(self) -> int:
        return sum(not drift for _, drift in self.nodes)


def pool_views() -> list[PoolView]:
    views = []
    for pool in NodePool.objects.prefetch_related("nodes", "deployments__model"):
        nodes = [(node, node_drift(node)) for node in pool.nodes.all()]
        views.append(PoolView(pool, list(pool.deployments.all()), nodes))
    return views
