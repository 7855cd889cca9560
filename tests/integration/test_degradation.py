"""Degradation tiers on the trio of real Triton nodes with a real Prometheus, driven by the real
worker and beat: the reranker slowed at runtime (the demo models' fault knob) breaks the
pipeline's budget, and the pool serves the tier without the reranker on every node by itself,
its P99 back under budget."""

from collections.abc import Iterator

import pytest

from apps.audit.models import AuditEvent
from apps.degradation.services import tiers_set
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.services import model_set_budget
from controlplane.catalog import budget_queries
from controlplane.prometheus import instant_query
from tests.support.fleet import STEPS_V2, STEPS_V4, converged, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
BUDGET_MS = 250  # v2 answers in about 40 ms here once warm


@pytest.fixture
def slowed(trio: tuple[Devfleet, FleetState]) -> Iterator[Devfleet]:
    devfleet, _ = trio
    try:
        yield devfleet
    finally:
        devfleet.fault("reranker")  # healed, whatever happened


def p99_ms(pool: NodePool, window_s: int) -> float:
    query = budget_queries(model="rag_pipeline", pool=pool.name, window_s=window_s)["p99"]
    found = instant_query(query)
    return found[0][1] if found else float("inf")


def test_a_slowed_reranker_breaks_the_budget_and_the_pool_steps_down_to_the_tier_without_it(
    serving_v1: NodePool, traffic: None, slowed: Devfleet
) -> None:
    deployment_set(model_name="rag_pipeline", version=2, pool=serving_v1, actor="system:test")
    wait_for("v2 everywhere", converged(serving_v1, STEPS_V2), timeout=90)
    wait_for("v2's P99 settled under budget", lambda: p99_ms(serving_v1, 10) < BUDGET_MS)
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=BUDGET_MS, actor="sre")
    tiers_set(pool_name=serving_v1.name, model_name="rag_pipeline", versions=[2, 4], actor="rm")
    assert not AuditEvent.objects.filter(action="pool.degrade").exists()

    slowed.fault("reranker", delay_ms=400)  # about the most each node can serve at 8 req/s
    wait_for("v4 (no reranker) on every node", converged(serving_v1, STEPS_V4), timeout=120)
    event = AuditEvent.objects.get(action="pool.degrade")
    assert event.actor == "system:degradation" and f"budget {BUDGET_MS} ms" in event.message
    assert (event.before["version"], event.outcome["version"]) == (2, 4)
    wait_for("the pipeline's P99 back under budget", lambda: p99_ms(serving_v1, 10) < BUDGET_MS)
