"""How fast a slow release is caught and undone: rag_pipeline v3 (+250 ms on every request) rolled
out with `failure_limit=1` on the trio of real Triton nodes, under real traffic, judged from a real
Prometheus by the real worker and beat.

Detection: from the canary READY on its node (`step_ready_at`) to the first failing measurement
(`first_failure_at`); by design at least warm-up + window (ANALYSIS: 5 s + 10 s). Reaction:
`rollout.rollback_duration`, from the first failing measurement to every canary node read back
serving the baseline only; target under 5 s. The bench also reads the canary node itself every
0.1 s, as a check on the product's own clock. Asserted: only that each rollout was rolled back and
read back; the times are reported.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_rollback_reaction.py -s -p no:cacheprovider`
"""

import statistics
import time
from datetime import datetime

import pytest
from django.utils import timezone

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.registry.services import model_set_budget
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from tests.support.bench import Report
from tests.support.fleet import (
    ANALYSIS,
    STEPS_V1,
    converged,
    ready_on,
    settled,
    traffic_to,
    wait_for,
)
from tests.support.services import Celery

ROUNDS = 3
TARGET_S = 5.0
POLL_S = 0.1
ACTOR = "release-manager"
State = Rollout.State


def pipeline_versions(node: Node) -> set[int]:
    return {v for m, v in ready_on(node) if m == "rag_pipeline"}


def one_rollback(pool: NodePool) -> tuple[Rollout, datetime]:
    """Roll out v3 until it is rolled back; also when the bench itself read the canary node back
    on v1 alone."""
    rollout = rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=3,
        plan="1 node, hold 60s\n100%",
        analysis={**ANALYSIS, "failure_limit": 1},
        actor=ACTOR,
    )
    found = Rollout.objects.filter(pk=rollout.pk)
    deadline = time.monotonic() + 150
    while not (row := found.get()).first_failure_at:
        assert row.state in Rollout.ACTIVE, f"#{row.pk} {row.state}: {row.reason}"
        assert time.monotonic() < deadline, f"#{row.pk} never failed a measurement"
        time.sleep(POLL_S)
    canary = list(pool.nodes.filter(name__in=row.canary_nodes))
    assert canary
    while any(pipeline_versions(node) != {1} for node in canary):
        assert time.monotonic() < deadline, f"#{row.pk}: the canary still serves v3"
        time.sleep(POLL_S)
    seen_at = timezone.now()
    wait_for(
        f"rollout #{row.pk} is rolled back",
        lambda: found.get().state not in Rollout.ACTIVE,
        timeout=60,
    )
    return found.get(), seen_at


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_slow_canary_is_detected_and_rolled_back_within_seconds(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery, report: Report
) -> None:
    began = time.perf_counter()
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:bench")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    # v3's reranker sleeps 250 ms on every batch: no request through it can meet this budget.
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=250, actor=ACTOR)
    detections: list[float] = []
    reactions: list[float] = []
    seen: list[float] = []
    on_v1 = settled(pool, STEPS_V1)
    with traffic_to(state):
        for _ in range(ROUNDS):
            wait_for("the pool is back on v1 with nothing open", on_v1, timeout=120)
            rollout, seen_at = one_rollback(pool)
            assert rollout.state == State.ROLLED_BACK, rollout.reason
            assert rollout.step_ready_at and rollout.first_failure_at and rollout.rolled_back_at
            duration = rollout.rollback_duration
            assert duration is not None
            detections.append((rollout.first_failure_at - rollout.step_ready_at).total_seconds())
            reactions.append(duration.total_seconds())
            seen.append((seen_at - rollout.first_failure_at).total_seconds())
            narrowed = (
                Operation.objects.filter(
                    node__name__in=rollout.canary_nodes,
                    model_name="rag_pipeline",
                    versions=[1],
                    created_at__gte=rollout.first_failure_at,
                )
                .order_by("id")
                .first()
            )
            assert narrowed and narrowed.started_at and narrowed.finished_at
            since = rollout.first_failure_at
            print(
                f"\n#{rollout.pk}: detection {detections[-1]:.2f} s, reaction {reactions[-1]:.2f} s"
                f" (bench read-back {seen[-1]:.2f} s); narrowing load planned "
                f"+{(narrowed.created_at - since).total_seconds():.2f} s, started "
                f"+{(narrowed.started_at - since).total_seconds():.2f} s, read back "
                f"+{(narrowed.finished_at - since).total_seconds():.2f} s; {rollout.reason}"
            )
    runtime = time.perf_counter() - began
    design = ANALYSIS["warmup_s"] + ANALYSIS["window_s"]
    bench = f"rollback of a slow canary (trio, {ROUNDS} rounds)"
    report.add(
        bench,
        "detection: canary READY -> first failing measurement, median",
        f"{statistics.median(detections):.2f} s ({_list(detections)})",
        f">= {design} s by design (warm-up + window)",
    )
    report.add(
        bench,
        "reaction: first failure -> canary on baseline only, median",
        f"{statistics.median(reactions):.2f} s ({_list(reactions)})",
        f"< {TARGET_S:g} s",
    )
    report.add(
        bench,
        "reaction as read back by the bench (0.1 s polls), median",
        f"{statistics.median(seen):.2f} s",
    )
    report.add(bench, "bench runtime (trio start excluded)", f"{runtime:.0f} s")


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)
