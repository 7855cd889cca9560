"""The nodes a pool needs, from what Prometheus read of it: the formula alone, no database and
no network, so every rule of it is tested as a function.

Three readings each ask for a number of nodes, and the pool gets the most any asks for, within
its bounds:
- **load**: each served release's request rate over what one node serves of it within the
  latency budget (its capacity, measured by perf_analyzer), at SCALING_TARGET_LOAD of that;
- **queue**: Triton's own Kubernetes recipe, the ratio of queue time to compute time of the
  worst step, scaled proportionally to SCALING_QUEUE_RATIO (an HPA's rule, its tolerance too);
- **GPU**: the pool's mean GPU utilization scaled proportionally to SCALING_GPU_UTILIZATION.
With none of them (Prometheus down, no series of the pool) there is no evidence: the signal
keeps the count it last had evidence for (the nodes the pool has, before any) and says why.
While a release runs on the pool (a rollout, a
blue-green switch, a degradation episode, a search) it never asks for fewer nodes than the pool
has: scale-out only, said so. A person's pin replaces it all."""

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Load:
    """One release the pool serves: its request rate, and one node's capacity of it if
    measured."""

    release: str  # "rag_pipeline v3"
    rate: float  # requests a second over the window
    per_node: float | None  # requests a second one node serves within the budget
    run: int | None = None  # the perf_analyzer run that measured it


@dataclass(frozen=True)
class Reading:
    """What Prometheus said of a pool over the window; None where it said nothing."""

    loads: list[Load] = field(default_factory=list)
    queue: tuple[str, float] | None = None  # the worst step and its queue-to-compute ratio
    gpu: float | None = None  # mean GPU utilization, 0 to 1
    unavailable: str = ""  # why Prometheus could not be read


@dataclass(frozen=True)
class Targets:
    load: float  # share of a node's capacity it should run at
    queue_ratio: float
    gpu: float
    tolerance: float = 0.1


@dataclass(frozen=True)
class Bounds:
    least: int = 1
    most: int | None = None
    pinned: int | None = None
    pinned_why: str = ""


@dataclass(frozen=True)
class Signal:
    wanted: int
    reasons: list[str]
    held: str = ""  # why it asks for no fewer than the pool has, if it does


def nodes_wanted(
    *,
    nodes: int,
    serving: int,
    reading: Reading,
    targets: Targets,
    bounds: Bounds = Bounds(),
    holds: list[str] | None = None,
    last: int | None = None,
) -> Signal:
    """`nodes`: the pool's nodes (what a scale-in removes from); `serving`: those in traffic
    (what carries the load the readings saw); `last`: the count asked for before."""
    if bounds.pinned is not None:
        return Signal(bounds.pinned, [f"pinned at {_nodes(bounds.pinned)}: {bounds.pinned_why}"])
    asks, reasons = _asks(serving, reading, targets)
    if not asks:
        why = reading.unavailable or "no request series of the pool in Prometheus"
        if last is None:
            return Signal(nodes, [f"no evidence ({why}): held at its {_nodes(nodes)}"])
        return Signal(last, [f"no evidence ({why}): keeps the {_nodes(last)} it last asked for"])
    wanted = max(asks)
    if wanted < bounds.least:
        wanted = bounds.least
        reasons.append(f"at least {_nodes(bounds.least)} (the pool's minimum)")
    if bounds.most is not None and wanted > bounds.most:
        wanted = bounds.most
        reasons.append(f"at most {_nodes(bounds.most)} (the pool's maximum)")
    held = ""
    if holds:
        held = "; ".join(holds)
        if wanted < nodes:
            reasons.append(f"held at its {_nodes(nodes)}, not {wanted}: {held} (no scale-in)")
            wanted = nodes
        elif wanted > nodes:
            reasons.append(f"scale-out while {held}: the new nodes join out of traffic")
    return Signal(wanted, reasons, held)


def _asks(serving: int, reading: Reading, targets: Targets) -> tuple[list[int], list[str]]:
    asks: list[int] = []
    reasons: list[str] = []
    measured = [load for load in reading.loads if load.per_node]
    if measured:
        share = sum(load.rate / load.per_node for load in measured if load.per_node)
        wanted = math.ceil(share / targets.load - 1e-9)
        asks.append(wanted)
        parts = ", ".join(
            f"{load.release} {load.rate:.1f}/s of {load.per_node:.1f} a node (run {load.run})"
            for load in measured
        )
        reasons.append(f"load: {parts}, at {targets.load:.0%} of capacity: {_nodes(wanted)}")
    if unmeasured := [load.release for load in reading.loads if not load.per_node]:
        reasons.append(f"no capacity measured of {', '.join(unmeasured)}: load not counted")
    if reading.queue is not None and serving:
        step, ratio = reading.queue
        wanted = _proportional(serving, ratio / targets.queue_ratio, targets.tolerance)
        asks.append(wanted)
        reasons.append(
            f"queue: {step} waits {ratio:.2f}x its compute time (its batching delay aside)"
            f" on {_nodes(serving)} in traffic"
            f" (target {targets.queue_ratio:g}x): {_nodes(wanted)}"
        )
    if reading.gpu is not None and serving:
        wanted = _proportional(serving, reading.gpu / targets.gpu, targets.tolerance)
        asks.append(wanted)
        reasons.append(
            f"GPU: {reading.gpu:.0%} busy on {_nodes(serving)} in traffic"
            f" (target {targets.gpu:.0%}): {_nodes(wanted)}"
        )
    return asks, reasons


def _proportional(serving: int, usage: float, tolerance: float) -> int:
    """An HPA's rule: the nodes in traffic times the reading over its target, unchanged within
    the tolerance (an HPA's 10 % by default: a reading at its target never flaps)."""
    if abs(usage - 1.0) <= tolerance:
        return serving
    return math.ceil(serving * usage - 1e-9)


def _nodes(count: int) -> str:
    return f"{count} node" + ("" if count == 1 else "s")
