"""A fleet's worth of data for benchmarks and query-count tests: pools of nodes whose indexes show
what they serve (a few drifting), models with versions and pipelines, deployments with canary
overrides, release history, operations, rollouts with measurements, and a long audit trail. Rows
are written in bulk, straight to the tables: nothing here talks to Triton."""

from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import cycle, islice

from django.db import transaction
from django.utils import timezone

from apps.audit.models import AuditEvent, target_parts
from apps.fleet.models import Deployment, Node, NodePool, Operation, Release
from apps.prometheus.catalog import canary_queries
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.results import Kind
from apps.rollouts.verdicts import Verdict

TENSOR = {"data_type": "TYPE_FP32", "dims": ["4"]}
STEPS_PER_PIPELINE = 3
MODELS_PER_POOL = 5  # one pipeline and its steps, and one more model


@dataclass(frozen=True)
class Size:
    nodes: int = 500
    pools: int = 10
    models: int = 50  # a fifth of them pipelines (ensembles) over the others
    versions: int = 10
    operations: int = 10_000
    rollouts: int = 20
    events: int = 100_000


def _standalone(name: str) -> dict:
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 8,
        "input": [{"name": "IN", **TENSOR}],
        "output": [{"name": "OUT", **TENSOR}],
    }


def _pipeline(name: str, steps: list[str], version: int) -> dict:
    chain = [
        {
            "model_name": step,
            "model_version": str(version),
            "input_map": {"IN": "IN" if i == 0 else f"t{i}"},
            "output_map": {"OUT": "OUT" if i == len(steps) - 1 else f"t{i + 1}"},
        }
        for i, step in enumerate(steps)
    ]
    return _standalone(name) | {
        "backend": "",
        "platform": "ensemble",
        "ensemble_scheduling": {"step": chain},
    }


@transaction.atomic
def seed_fleet(*, size: Size, prefix: str = "") -> None:
    """Add `size` worth of everything, names starting with `prefix` (so it can run twice)."""
    now = timezone.now()
    pipelines = max(1, size.models // 5)
    names = [f"{prefix}model-{i:03d}" for i in range(size.models - pipelines)]
    pipes = [f"{prefix}pipeline-{i:02d}" for i in range(pipelines)]
    steps = {pipe: list(islice(cycle(names), i * 3, i * 3 + 3)) for i, pipe in enumerate(pipes)}
    models = Model.objects.bulk_create(
        [Model(name=n) for n in names]
        + [Model(name=p, kind=Model.Kind.ENSEMBLE, backend="ensemble") for p in pipes]
    )
    by_name = {m.name: m for m in models}
    ModelVersion.objects.bulk_create(
        ModelVersion(
            model=by_name[name],
            version=v,
            config=_pipeline(name, steps[name], v) if name in steps else _standalone(name),
            status=ModelVersion.Status.PUBLISHED,
        )
        for name in names + pipes
        for v in range(1, size.versions + 1)
    )
    pools = NodePool.objects.bulk_create(
        NodePool(name=f"{prefix}pool-{i:02d}") for i in range(size.pools)
    )
    current = size.versions
    wanted: dict[int, list[str]] = {}  # pool id -> the models deployed there
    for i, pool in enumerate(pools):
        pipe = pipes[i % len(pipes)]
        extra = names[(i * 7) % len(names)]
        wanted[pool.pk] = sorted({pipe, *steps[pipe], extra})
    Deployment.objects.bulk_create(
        Deployment(pool=pool, model=by_name[name], version=current, created_by="seed")
        for pool in pools
        for name in wanted[pool.pk]
    )
    Release.objects.bulk_create(
        Release(
            pool=pool,
            model=by_name[name],
            version=v,
            started_at=now - timedelta(days=size.versions - v + 1),
            ended_at=None if v == current else now - timedelta(days=size.versions - v),
            started_by="seed",
            rolled_back=v == current - 2,
        )
        for pool in pools
        for name in wanted[pool.pk]
        for v in range(max(1, current - 3), current + 1)
    )

    def index(pool: NodePool, drifting: bool) -> list[dict]:
        return [
            {
                "model": name,
                "version": str(current - 1 if drifting and j == 0 else current),
                "state": "READY",
                "reason": "",
            }
            for j, name in enumerate(wanted[pool.pk])
        ]

    nodes = Node.objects.bulk_create(
        Node(
            name=f"{prefix}node-{i:04d}",
            pool=pools[i % len(pools)],
            http_url=f"http://10.{i // 250}.{i % 250}.1:8000",
            health=Node.Health.UNREACHABLE if i % 97 == 5 else Node.Health.READY,
            last_seen=now,
            triton_version="2.51.0",
            index=index(pools[i % len(pools)], drifting=i % 50 == 7),
            owned=wanted[pools[i % len(pools)].pk],
        )
        for i in range(size.nodes)
    )
    canaries = nodes[:: max(1, len(nodes) // 10)]  # a canary node with an override per 10%
    Deployment.objects.bulk_create(
        Deployment(
            node=node,
            model=by_name[names[0]],
            version=current - 1,
            baseline_version=current,
            created_by="seed",
        )
        for node in canaries
    )
    statuses = cycle([Operation.Status.SUCCEEDED] * 8 + [Operation.Status.FAILED])
    Operation.objects.bulk_create(
        Operation(
            node=nodes[i % len(nodes)],
            kind=Operation.Kind.LOAD,
            model_name=wanted[nodes[i % len(nodes)].pool_id][0],
            versions=[current],
            status=next(statuses),
            requested_by="system:reconciler",
            started_at=now - timedelta(seconds=size.operations - i + 1),
            finished_at=now - timedelta(seconds=size.operations - i),
            error="",
        )
        for i in range(size.operations)
    )
    states = cycle([Rollout.State.SUCCEEDED, Rollout.State.ROLLED_BACK, Rollout.State.FAILED])
    rollouts = Rollout.objects.bulk_create(
        Rollout(
            model=by_name[pipes[i % len(pipes)]],
            pool=pools[i % len(pools)],
            baseline_version=current - 1,
            canary_version=current,
            plan=[{"nodes": 1, "hold_s": 60}, {"percent": 100}],
            state=next(states),
            started_by="seed",
            finished_at=now,
        )
        for i in range(size.rollouts)
    )
    rounds = Round.objects.bulk_create(
        Round(rollout=rollout, step=0, number=number, verdict=Verdict.SUCCESS)
        for rollout in rollouts
        for number in range(1, 11)
    )
    Measurement.objects.bulk_create(
        Measurement(
            rollout=judged.rollout,
            round=judged,
            step=0,
            kind=kind,
            metric=metric,
            query=canary_queries(
                model=judged.rollout.model.name, pool=judged.rollout.pool.name, window_s=60
            )["p99"],
            canary_value=100.0,
            baseline_value=90.0,
            threshold=120.0,
            verdict=Verdict.SUCCESS,
        )
        for judged in rounds
        for kind, metric in [
            (Kind.REQUESTS, "requests"),
            (Kind.LATENCY, "p99"),
            (Kind.ERRORS, "error_ratio"),
        ]
    )
    _seed_events(size.events, [n.name for n in nodes], now)


def _seed_events(count: int, nodes: list[str], now: datetime) -> None:
    """`count` events over the last 30 days. `created_at` is set on purpose (history), which
    auto_now_add would overwrite: it is switched off for this insert only."""
    field = AuditEvent._meta.get_field("created_at")
    step = timedelta(days=30) / max(1, count)
    field.auto_now_add = False  # type: ignore[attr-defined]
    try:
        for start in range(0, count, 5000):
            AuditEvent.objects.bulk_create(
                _load_event(now - step * (count - i), f"node:{nodes[i % len(nodes)]}:model")
                for i in range(start, min(count, start + 5000))
            )
    finally:
        field.auto_now_add = True  # type: ignore[attr-defined]


def _load_event(at: datetime, target: str) -> AuditEvent:
    return AuditEvent(
        created_at=at,
        actor="system:reconciler",
        action="operation.load",
        target=target,
        **target_parts(target),
        after={"versions": [1]},
    )
