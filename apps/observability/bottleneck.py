"""Where an ensemble's time goes in a pool, from its steps' own counters (Triton's ensemble-level
timings mislead: parallel branches, zero queue time), and what to change about the step that
holds it back, with the numbers that say so and what the change should do."""

import math
from dataclasses import dataclass, field, replace
from typing import Any

from apps.fleet.models import Deployment
from apps.prometheus.catalog import bottleneck_query
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.ensembles import UnresolvedStep
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import stored_steps

WINDOW_S = 300
# Judgement needs evidence: under this many requests of a step in the window, nothing is named.
MIN_REQUESTS = 100
# Advice thresholds. An instance busy more than BUSY of the time queues its requests; a GPU
# busier than SATURATED on average has no room for another instance.
QUEUE_OVER_COMPUTE = 2.0
BUSY = 0.7
SATURATED = 0.9
SMALL_BATCH = 0.5  # of max_batch_size
BATCHING_RATE = 20.0  # executions per second from which waiting to batch costs little


@dataclass(frozen=True)
class StepConfig:
    """What of a step's config the advice reads."""

    instances: int  # summed over its instance groups; 1 where it names none (Triton's default)
    default_instances: bool
    max_batch_size: int
    batching_delay_us: int | None  # None: no dynamic batching

    @classmethod
    def of(cls, config: Any) -> "StepConfig":
        """From a parsed config (ModelConfig)."""
        groups = config.instance_group
        batching = config.HasField("dynamic_batching")
        return cls(
            instances=sum(group.count or 1 for group in groups) or 1,
            default_instances=not groups,
            max_batch_size=config.max_batch_size,
            batching_delay_us=config.dynamic_batching.max_queue_delay_microseconds
            if batching
            else None,
        )


@dataclass(frozen=True)
class Step:
    model: str
    version: int
    config: StepConfig
    requests: float  # that succeeded in the window
    rate: float  # requests per second
    executions_rate: float
    queue_ms: float  # mean per request
    input_ms: float
    infer_ms: float
    output_ms: float
    pending: float  # requests waiting on all its nodes, averaged over the window
    nodes: int  # that served it in the window
    batch: float | None  # mean requests per execution
    share: float = 0.0  # of the pipeline's time per request

    @property
    def compute_ms(self) -> float:
        return self.input_ms + self.infer_ms + self.output_ms

    @property
    def time_ms(self) -> float:
        return self.queue_ms + self.compute_ms

    @property
    def busy(self) -> float:
        """The fraction of the time its instances compute: executions/s x compute per execution
        (Triton counts a batch's compute time on each of its requests) / instances on all its
        nodes."""
        return self.executions_rate * self.compute_ms / 1000 / self.instances

    @property
    def instances(self) -> int:
        return self.config.instances * max(self.nodes, 1)


GPU_MEASURES = ("gpu_util", "gpu_util_peak", "gpu_used_bytes", "gpu_total_bytes")


@dataclass(frozen=True)
class Gpus:
    """The pool's GPUs, in GPU_MEASURES' order; None where there are none (a CPU pool)."""

    utilization: float | None  # mean over the pool's GPUs and the window, 0..1
    peak: float | None
    used_bytes: float | None
    total_bytes: float | None


@dataclass(frozen=True)
class Advice:
    step: str
    change: str
    because: str
    expect: str
    fields: dict[str, Any] = field(default_factory=dict)  # the config fields it changes


@dataclass(frozen=True)
class Bottleneck:
    steps: list[Step]  # pipeline order
    gpus: Gpus
    slowest: Step | None  # None when the evidence is too thin
    waiting: str  # why nothing is named, when nothing is
    advice: list[Advice]


def bottleneck(steps: dict[tuple[str, int], Any], pool: str) -> Bottleneck:
    """An ensemble's `steps` in `pool` ((model, version) -> parsed config, in pipeline order:
    `pinned_steps`), read from Prometheus in one query (PrometheusUnavailable when it cannot)."""
    rows = instant_query(
        bottleneck_query(steps=[m for m, _ in steps], pool=pool, window_s=WINDOW_S)
    )
    found: dict[tuple[str, str], float] = {
        (labels.get("model", ""), labels["measure"]): value
        for labels, value in rows
        if math.isfinite(value)
    }
    measured = [
        _step(model, version, StepConfig.of(config), found)
        for (model, version), config in steps.items()
    ]
    total = sum(step.time_ms for step in measured)
    measured = [replace(s, share=s.time_ms / total if total else 0.0) for s in measured]
    gpus = Gpus(*(found.get(("", measure)) for measure in GPU_MEASURES))
    thin = [s for s in measured if s.requests < MIN_REQUESTS]
    if thin or not measured:
        waiting = "; ".join(
            f"{s.model} served {s.requests:.0f} requests in {WINDOW_S // 60} min" for s in thin
        )
        why = f"too few requests to judge (at least {MIN_REQUESTS} a step): {waiting or 'no steps'}"
        return Bottleneck(measured, gpus, None, why, [])
    slowest = max(measured, key=lambda s: s.time_ms)
    return Bottleneck(measured, gpus, slowest, "", advise(slowest, gpus))


def _step(
    model: str, version: int, config: StepConfig, found: dict[tuple[str, str], float]
) -> Step:
    def total(measure: str) -> float:
        return found.get((model, measure), 0.0)

    requests, executions = total("requests"), total("executions")

    def per_request(measure: str) -> float:
        return total(measure) / requests / 1000 if requests else 0.0

    return Step(
        model=model,
        version=version,
        config=config,
        requests=requests,
        rate=requests / WINDOW_S,
        executions_rate=executions / WINDOW_S,
        queue_ms=per_request("queue_us"),
        input_ms=per_request("input_us"),
        infer_ms=per_request("infer_us"),
        output_ms=per_request("output_us"),
        pending=total("pending"),
        nodes=int(total("nodes")),
        batch=total("inferences") / executions if executions else None,
    )


def advise(step: Step, gpus: Gpus) -> list[Advice]:
    """What to change about the slowest step, each with the numbers that led to it."""
    config, found = step.config, []
    saturated = gpus.utilization is not None and gpus.utilization >= SATURATED
    if saturated:
        found.append(
            Advice(
                step.model,
                "more nodes, not instances",
                f"the pool's GPUs are {gpus.utilization:.0%} busy on average: another instance "
                "would share the same GPU",
                "more nodes in the pool spread its requests: queue time falls as the load per GPU "
                "does",
            )
        )
    if not saturated and step.queue_ms > QUEUE_OVER_COMPUTE * step.compute_ms and step.pending > 0:
        # A node's share of the compute, in instances' worth, each busy BUSY of the time at most.
        wanted = max(config.instances + 1, math.ceil(step.busy * config.instances / BUSY))
        idle = "" if gpus.utilization is None else f", GPUs {gpus.utilization:.0%} busy"
        found.append(
            Advice(
                step.model,
                f"more instances: {config.instances} -> {wanted}",
                f"requests wait {step.queue_ms:.1f} ms for {step.compute_ms:.1f} ms of compute, "
                f"{step.pending:.1f} pending on average over its {step.nodes} node(s); "
                f"{config.instances} instance(s) a node compute {step.busy:.0%} of the time at "
                f"{step.rate:.1f} requests/s{idle}",
                f"{wanted} instances at the same load compute about "
                f"{step.busy * config.instances / wanted:.0%} of the time: queue time should "
                f"fall toward its compute time and throughput rise",
                {"instance_group": [{"count": wanted}]},
            )
        )
    small = step.batch is not None and step.batch < SMALL_BATCH * config.max_batch_size
    if (
        config.max_batch_size > 1
        and small
        and step.executions_rate >= BATCHING_RATE
        and not config.batching_delay_us
    ):
        delay_us = max(100, int(step.compute_ms * 1000 / 4))
        found.append(
            Advice(
                step.model,
                f"a dynamic-batching delay of {delay_us} us",
                f"batches average {step.batch:.1f} of up to {config.max_batch_size} at "
                f"{step.executions_rate:.0f} executions/s, with "
                + ("no dynamic batching" if config.batching_delay_us is None else "no delay"),
                f"waiting up to {delay_us / 1000:.2f} ms (a quarter of its compute) gathers larger "
                "batches: fewer executions for the same requests",
                {"dynamic_batching": {"max_queue_delay_microseconds": str(delay_us)}},
            )
        )
    return found


class BottleneckUnread(Exception):
    """Why a pool's bottleneck could not be read; the message says it."""


def bottleneck_in(ensemble: Model, pool: str) -> tuple[int, Bottleneck]:
    """The version of `ensemble` in `pool` (its deployment there, else its newest published
    one) and its bottleneck; raises BottleneckUnread."""
    here = Deployment.objects.filter(model=ensemble, pool__name=pool, node=None).first()
    published = ensemble.versions.filter(status=ModelVersion.Status.PUBLISHED)
    number = (
        here.version
        if here
        else published.order_by("-version").values_list("version", flat=True).first()
    )
    version = ensemble.versions.filter(version=number).first() if number else None
    if version is None:
        raise BottleneckUnread(f"{ensemble.name} has no version deployed to {pool} or published.")
    try:
        steps = stored_steps(version.config)
        return version.version, bottleneck(steps, pool)
    except UnresolvedStep as exc:
        raise BottleneckUnread(f"{ensemble.name} v{version.version}: {exc}") from None
    except PrometheusUnavailable as exc:
        raise BottleneckUnread(f"Where the time goes is read from Prometheus: {exc}") from None
