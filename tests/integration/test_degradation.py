"""Degradation tiers on the trio of real Triton nodes with a real Prometheus, driven by the real
worker and beat: the reranker slowed at runtime (the demo models' fault knob) breaks the
pipeline's budget, and the pool serves the tier without the reranker on every node by itself,
its P99 back under budget; healed, the pool comes back after the dwell, on the evidence of
probes; a flapping fault switches it twice, then freezes it and pages a person."""

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.degradation import automation
from apps.degradation.models import Tiers
from apps.degradation.services import tiers_set
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.incidents.models import Incident
from apps.observability.markers import change_markers
from apps.prometheus.catalog import budget_queries
from apps.prometheus.client import instant_query
from apps.registry.services import model_set_budget
from tests.support.fleet import STEPS_V2, STEPS_V4, converged, flapping, wait_for

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
    nodes = list(pool.nodes.in_traffic().values_list("name", flat=True))
    query = budget_queries(
        model="rag_pipeline", steps=[], pool=pool.name, nodes=nodes, window_s=window_s
    )["p99"]
    found = instant_query(query)
    return found[0][1] if found else float("inf")


def with_tiers(pool: NodePool) -> None:
    """The pool serving v2, within its budget of BUDGET_MS, with tiers v2 > v4 (no reranker)."""
    deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor="system:test")
    wait_for("v2 everywhere", converged(pool, STEPS_V2), timeout=90)
    wait_for("v2's P99 settled under budget", lambda: p99_ms(pool, 10) < BUDGET_MS)
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=BUDGET_MS, actor="sre")
    tiers_set(pool_name=pool.name, model_name="rag_pipeline", versions=[2, 4], actor="rm")


def switches() -> list[str]:
    moves = AuditEvent.objects.filter(action__in=["pool.degrade", "pool.restore"])
    return list(moves.order_by("id").values_list("action", flat=True))


def test_a_slowed_reranker_breaks_the_budget_the_pool_steps_down_and_comes_back_once_healed(
    serving_v1: NodePool, traffic: None, slowed: Devfleet, client: Client, viewer: User
) -> None:
    with_tiers(serving_v1)
    assert switches() == []
    tiers = Tiers.objects.select_related("model", "pool").get()
    nodes = [node.name for node in serving_v1.nodes.in_traffic()]
    read = automation._window(tiers, automation._steps(tiers, 2), nodes, 10)  # the trigger's own
    assert (
        read.compute_us and read.queue_ratio is not None and read.queue_ratio < 4
    )  # not saturated

    slowed.fault("reranker", delay_ms=400)  # about the most each node can serve at 8 req/s
    # v4 served everywhere; v2 stays READY beside it, for probes and the way back.
    wait_for("v4 on every node", converged(serving_v1, STEPS_V2 | STEPS_V4), timeout=120)
    event = AuditEvent.objects.get(action="pool.degrade")
    assert event.actor == "system:degradation" and f"budget {BUDGET_MS} ms" in event.message
    assert (event.before["version"], event.outcome["version"]) == (2, 4)
    wait_for("the pipeline's P99 back under budget", lambda: p99_ms(serving_v1, 10) < BUDGET_MS)

    slowed.fault("reranker")  # healed: after the dwell (65 s here), v2 is probed, then served
    wait_for("back on v2 everywhere", converged(serving_v1, STEPS_V2), timeout=150)
    back = AuditEvent.objects.get(action="pool.restore")
    nodes = ", ".join(sorted(node.name for node in serving_v1.nodes.all()))
    assert back.actor == "system:degradation"
    assert back.message.startswith("probes of v2: P99 ")
    assert back.message.endswith(f" ms over 60 requests on {nodes}, budget {BUDGET_MS} ms")
    assert back.outcome["version"] == 2
    held = back.created_at.timestamp() - event.created_at.timestamp()
    assert held >= 65  # the dwell
    client.force_login(viewer)
    page = client.get(f"/pools/{serving_v1.name}/tiers/").content.decode()
    assert back.message in page  # the probes' evidence, on the page
    wait_for("v2's P99 under budget", lambda: p99_ms(serving_v1, 10) < BUDGET_MS)
    assert switches() == ["pool.degrade", "pool.restore"]
    assert Tiers.objects.get().frozen_at is None
    drawn = change_markers(
        start=event.created_at - timedelta(minutes=1),
        end=timezone.now(),
        model="rag_pipeline",
        pool=serving_v1.name,
    )
    labels = [marker.label for marker in drawn]  # on the P99 chart
    assert "step down rag_pipeline v4" in labels and "step back up rag_pipeline v2" in labels


@pytest.mark.timeout(480)
def test_a_flapping_fault_switches_twice_then_freezes_and_pages_a_person(
    serving_v1: NodePool, traffic: None, slowed: Devfleet
) -> None:
    """Slow for 20 s, fine for 20 s, until the automation freezes itself and one more cycle after
    it (at most 5 minutes): never a switch per cycle. `make bench` flaps the full 5 minutes
    (tests/bench/test_degradation_reaction.py)."""
    with_tiers(serving_v1)
    said: list[str] = []  # what the automation said at each turn, should it fail
    frozen_at = None
    for elapsed in flapping(slowed, "reranker", seconds=300):
        said.append(f"{elapsed:.0f} s: {Tiers.objects.get().said}")
        if frozen_at is None and Tiers.objects.filter(frozen_at__isnull=False).exists():
            frozen_at = len(said)
        if frozen_at is not None and len(said) == frozen_at + 2:
            break
    assert frozen_at is not None, "\n".join(said)
    assert switches() == ["pool.degrade", "pool.restore"], "\n".join(said)
    frozen = AuditEvent.objects.get(action="pool.freeze_tiers")
    assert frozen.message.startswith("2 switches in the last hour, and another one due: P99 ")
    incident = Incident.objects.get()
    assert (incident.severity, incident.status) == ("critical", "open")
    assert "froze: 2 switches in the last hour" in incident.notes
