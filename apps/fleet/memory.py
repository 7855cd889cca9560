"""Memory-aware loads, on nodes with a memory limit (CPU) or GPUs. Each model version's
footprint per kind of device is what its backend reports it holds after a load that added it
alone (Triton's statistics, `memory_usage`) or, where the backend reports nothing, the node's
memory in use (Triton's CPU memory metric, or its GPUs' summed) just before and one metrics
interval after that load; a declared estimate (the registry's `memory_mb`) stands in until one
is measured. Before a load, the versions it adds must fit, with headroom, in what the node has
free: its limit less what its READY versions take, or its emptiest GPU's total less its use, as
Prometheus read them within FLEET_MEMORY_MAX_AGE_S (or, while Prometheus is away, as the node's
own poll read them within that time). A version whose footprint is known neither
way, or a node whose room is unknown, is let through, and measured."""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.fleet.desired import DesiredStateError, FleetDesired, Wanted, fleet_desired
from apps.fleet.models import Footprint, Node, NodePool
from apps.fleet.node_metrics import parse_cpu_memory_used, parse_gpu_memory, read_metrics
from apps.fleet.triton import TritonClient
from apps.prometheus.catalog import gpu_memory_query
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.models import ModelVersion

MIB = 2**20
Pair = tuple[str, int]  # (model, version)
Devices = list[dict] | str  # a node's GPUs (uuid, total and used bytes), or why none are known


def aware(node: Node) -> bool:
    return bool(node.memory_limit_mb or node.gpus)


def device(node: Node) -> str:
    return Footprint.Device.GPU if node.gpus else Footprint.Device.CPU


def used_mb(node: Node) -> float | None:
    """The node's memory in use now, MiB: its GPUs' together, or its host's. None when its
    metrics do not say."""
    text = read_metrics(node.metrics_url, node=node.name)
    if node.gpus:
        return sum(gpu["used"] for gpu in parse_gpu_memory(text)) / MIB
    used = parse_cpu_memory_used(text)
    return None if used is None else used / MIB


def sizes(pairs: Iterable[Pair], kind: str) -> dict[Pair, tuple[float, str]]:
    """Each version's footprint on `kind` devices and where it comes from; left out when it is
    neither measured nor declared."""
    wanted = set(pairs)
    names = {name for name, _ in wanted}
    found: dict[Pair, tuple[float, str]] = {}
    declared = ModelVersion.objects.filter(model__name__in=names, memory_mb__isnull=False)
    for name, version, declared_mb in declared.values_list("model__name", "version", "memory_mb"):
        if (name, version) in wanted and declared_mb is not None:
            found[name, version] = (float(declared_mb), "declared")
    measured = Footprint.objects.filter(model_name__in=names, device=kind)
    for name, version, mb, samples in measured.values_list(
        "model_name", "version", "mb", "samples"
    ):
        if (name, version) in wanted:
            found[name, version] = (mb, f"measured, {samples} load{'s' * (samples > 1)}")
    return found


@dataclass
class Room:
    """What a node has free for more models, as far as is known (`free_mb` None: unknown, and
    everything fits); `taken` is what its READY versions take, largest first."""

    free_mb: float | None
    where: str
    known: dict[Pair, tuple[float, str]] = field(default_factory=dict)
    taken: list[tuple[str, float]] = field(default_factory=list)

    def need(self, pairs: Iterable[Pair]) -> float:
        return sum(self.known.get(pair, (0.0, ""))[0] for pair in pairs)

    def fits(self, mb: float, freed: float = 0.0) -> bool:
        """Whether `mb` more fits, with headroom, once `freed` is given back first."""
        if self.free_mb is None:
            return True
        return mb * (1 + settings.FLEET_MEMORY_HEADROOM) <= self.free_mb + freed

    def take(self, mb: float) -> None:
        if self.free_mb is not None:
            self.free_mb -= mb


def gpu_memory(nodes: Iterable[Node]) -> dict[str, Devices]:
    """The GPUs of those of `nodes` that have any, as Prometheus last read them: one query,
    however many nodes. While Prometheus is away, as each node's own poll read them."""
    with_gpus = [node for node in nodes if node.gpus]
    names = [node.name for node in with_gpus]
    if not names:
        return {}
    try:
        rows = instant_query(gpu_memory_query(names, settings.FLEET_MEMORY_MAX_AGE_S))
    except PrometheusUnavailable as exc:
        return {node.name: _own_reading(node) or str(exc) for node in with_gpus}
    found: dict[str, dict[str, dict]] = {name: {} for name in names}
    for labels, value in rows:
        uuid = labels["gpu_uuid"]
        gpu = found[labels["node"]].setdefault(uuid, {"uuid": uuid, "total": 0.0, "used": 0.0})
        gpu["total" if "total" in labels["__name__"] else "used"] = value
    return {name: list(gpus.values()) for name, gpus in found.items()}


def _own_reading(node: Node) -> list[dict]:
    """The node's GPUs as its last poll read them from its own /metrics, if as recent as a
    Prometheus reading would have to be; each marked as read there."""
    if node.gpus_read_at is None:
        return []
    if (timezone.now() - node.gpus_read_at).total_seconds() > settings.FLEET_MEMORY_MAX_AGE_S:
        return []
    return [gpu | {"read": "node"} for gpu in node.gpus if "total" in gpu and "used" in gpu]


def room(
    node: Node,
    ready: dict[str, set[int]],
    coming: Iterable[Pair] = (),
    known: dict[Pair, tuple[float, str]] | None = None,
    devices: Devices | None = None,
) -> Room:
    """The node's room now, `ready` being what it serves; `coming`: versions whose footprints
    the caller will ask about (or `known`, footprints the caller has read); `devices`: its GPUs,
    where the caller has read them (`gpu_memory`)."""
    serving = {(name, v) for name, versions in ready.items() for v in versions}
    if known is None:
        known = sizes(serving | set(coming), device(node))
    taken = sorted(
        ((f"{name} v{v}", known[name, v][0]) for name, v in serving if (name, v) in known),
        key=lambda item: -item[1],
    )
    if node.gpus:
        if devices is None:
            devices = gpu_memory([node])[node.name]
        if isinstance(devices, str):
            return Room(None, f"its GPUs (unknown: {devices})", known, taken)
        if not devices:
            age = f"{settings.FLEET_MEMORY_MAX_AGE_S:g} s"
            why = f"its GPUs (Prometheus has no reading of the last {age})"
            return Room(None, why, known, taken)
        best = max(devices, key=lambda gpu: gpu["total"] - gpu["used"])
        free = (best["total"] - best["used"]) / MIB
        where = f"GPU {best['uuid']} of {best['total'] / MIB:.0f} MiB"
        if best.get("read") == "node":
            where += " (from the node's own metrics, Prometheus is away)"
        return Room(free, where, known, taken)
    if node.memory_limit_mb is None:
        return Room(None, "the node (no memory limit)", known, taken)
    free = node.memory_limit_mb - sum(mb for _, mb in taken)
    return Room(free, f"the node's {node.memory_limit_mb} MiB limit", known, taken)


def refusal(node: Node, model: str, adding: set[int], ready: dict[str, set[int]]) -> str:
    """Why loading `adding` versions of `model` beside what the node serves would not fit, or
    "" when it fits (or nothing says it would not)."""
    pairs = {(model, v) for v in adding}
    found = room(node, ready, pairs)
    need = found.need(pairs)
    if not need or found.fits(need):
        return ""
    assert found.free_mb is not None
    versions = ", ".join(
        f"v{v} {found.known[model, v][0]:.0f} MiB ({found.known[model, v][1]})"
        for v in sorted(adding)
        if (model, v) in found.known
    )
    headroom = settings.FLEET_MEMORY_HEADROOM
    biggest = ", ".join(f"{name} ({mb:.0f} MiB)" for name, mb in found.taken[:3])
    return (
        f"does not fit, not sent: {model} {versions} needs {need * (1 + headroom):.0f} MiB "
        f"with {headroom:.0%} headroom; {found.where} has {max(found.free_mb, 0):.0f} MiB free"
        + (f"; unloading {biggest} would free the most" if biggest else "")
    )


def measure(node: Node, client: TritonClient, model: str, version: int, before_mb: float) -> None:
    """Record the load of `version` alone: what its backend reports it holds on the node's kind
    of device (Triton's statistics) or, where it reports nothing, the node's memory one metrics
    interval later less `before_mb`. A reading that went down (something else freed memory
    meanwhile) says nothing."""
    kinds = ("GPU",) if node.gpus else ("CPU", "CPU_PINNED")
    reported = client.memory_usage(model, version)
    if held := sum(reported.get(kind, 0) for kind in kinds):
        _record(node, model, version, held / MIB, Footprint.Source.BACKEND)
        return
    time.sleep(settings.FLEET_FOOTPRINT_SETTLE_S)
    after = used_mb(node)
    if after is not None and after > before_mb:
        _record(node, model, version, after - before_mb, Footprint.Source.METRICS)


def _record(node: Node, model: str, version: int, mb: float, source: str) -> None:
    with transaction.atomic():
        found, created = Footprint.objects.select_for_update().get_or_create(
            model_name=model,
            version=version,
            device=device(node),
            defaults={"mb": mb, "source": source},
        )
        if not created:
            found.mb = (found.mb * found.samples + mb) / (found.samples + 1)
            found.samples += 1
            found.source = source
            found.save(update_fields=["mb", "samples", "source", "updated_at"])


def measuring(node: Node, model: str, version: int) -> bool:
    """Whether a load of `version` alone should be measured: too few samples so far."""
    taken = Footprint.objects.filter(model_name=model, version=version, device=device(node))
    samples = taken.values_list("samples", flat=True).first() or 0
    return samples < settings.FLEET_FOOTPRINT_SAMPLES


@dataclass(frozen=True)
class Capacity:
    """A node's memory as a pool's capacity page shows it."""

    node: Node
    room: Room
    reserved_mb: float  # what its desired state takes once converged, as far as is known
    pending: list[tuple[str, float | None]]  # desired versions not READY yet, and their need
    unknown: int  # desired versions with no footprint, measured or declared
    freed_mb: float = 0.0  # what the models it switches give back first, where they must
    error: str = ""  # its desired state cannot be computed

    @property
    def need_mb(self) -> float:
        return sum(mb or 0.0 for _, mb in self.pending)

    @property
    def fits(self) -> bool:
        """Whether what it still has to load fits in what it has free."""
        return self.room.fits(self.need_mb, self.freed_mb)


@dataclass(frozen=True)
class _Plan:
    """A node, what it serves, and what some desired state wants of it (`before`: what it
    wanted before the change asked about)."""

    node: Node
    serving: dict[str, set[int]]
    wanted: set[Pair]
    error: str = ""
    before: set[Pair] = field(default_factory=set)

    @property
    def have(self) -> set[Pair]:
        return {(m, v) for m, versions in self.serving.items() for v in versions}

    def freed(self, room: Room) -> float:
        """What the versions it drops of the models it switches take: where new and old would
        not fit side by side, the planner unloads the old first (break before make)."""
        switching = {model for model, _ in self.wanted - self.have}
        return room.need(pair for pair in self.have - self.wanted if pair[0] in switching)


def _plans(nodes: list[Node], desired: FleetDesired, change: Wanted) -> list[_Plan]:
    found = []
    for node in nodes:
        serving = {m: set(versions) for m, versions in node.ready_versions.items()}
        try:
            before, after = (desired.with_change(node, c) for c in ({}, change))
        except DesiredStateError as exc:
            found.append(_Plan(node, serving, set(), str(exc)))
            continue
        pairs = [
            {(m.name, v) for m in state.values() for v in m.versions} for state in (before, after)
        ]
        found.append(_Plan(node, serving, pairs[1], before=pairs[0]))
    return found


def _rooms(plans: list[_Plan]) -> list[Room]:
    """Each plan's node's room, knowing every footprint it involves: one read per kind of
    device, however many nodes."""
    known = {
        kind: sizes(
            {pair for p in plans if device(p.node) == kind for pair in p.wanted | p.have}, kind
        )
        for kind in {device(p.node) for p in plans}
    }
    gpus = gpu_memory(p.node for p in plans)
    return [
        room(p.node, p.serving, known=known[device(p.node)], devices=gpus.get(p.node.name))
        for p in plans
    ]


def capacity(nodes: list[Node], desired: FleetDesired) -> list[Capacity]:
    """Each node's room, what its desired state reserves and what it still has to load."""
    plans = _plans(nodes, desired, {})
    found = []
    for plan, here in zip(plans, _rooms(plans), strict=True):
        pending = sorted(plan.wanted - plan.have)
        sized = here.known
        found.append(
            Capacity(
                plan.node,
                here,
                here.need(plan.wanted),
                [(f"{m} v{v}", sized[m, v][0] if (m, v) in sized else None) for m, v in pending],
                sum(1 for pair in plan.wanted if pair not in sized),
                plan.freed(here),
                plan.error,
            )
        )
    return found


def shortfalls(
    pool: NodePool, nodes: list[Node], change: Wanted, *, new_only: bool = True
) -> list[str]:
    """Where `change` (deployments, as desired states take them) would not fit, were it deployed
    on each of `nodes` of `pool` beside the pool's desired state: each memory-aware node where
    what it still has to load, with the change, does not fit in its room (less what a switch
    unloads first), and the change adds versions to its desired state (`new_only`; else
    wherever the change leaves it short). A change that cannot be resolved says why
    elsewhere."""
    desired = fleet_desired(pool_ids=[pool.pk])
    plans = [p for p in _plans([n for n in nodes if aware(n)], desired, change) if not p.error]
    headroom = 1 + settings.FLEET_MEMORY_HEADROOM
    short = []
    for plan, here in zip(plans, _rooms(plans), strict=True):
        pending = plan.wanted - plan.have
        added = {
            pair for pair in pending - (plan.before if new_only else set()) if pair in here.known
        }
        need, freed = here.need(pending), plan.freed(here)
        if not added or here.fits(need, freed):
            continue
        other = need - here.need(added)
        short.append(
            f"{plan.node.name} needs {need * headroom:.0f} MiB with headroom for "
            + ", ".join(f"{m} v{v}" for m, v in sorted(added))
            + (f" and the {other:.0f} MiB it still has to load" if other else "")
            + f"; {here.where} has {max(here.free_mb or 0, 0):.0f} MiB free"
            + (f", {freed:.0f} more once it unloads what it switches from" if freed else "")
        )
    return short
