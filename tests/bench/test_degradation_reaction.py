"""How fast a pool steps down its tiers once its pipeline's budget breach is measurable, and how
it holds under a fault flapping for 5 minutes: the trio of real Triton nodes serving rag_pipeline
v2 (tiers v2 > v4, without the reranker) under real traffic, the reranker slowed at runtime, the
real worker and beat judging from a real Prometheus. And the same on what users of a streamed
answer feel: the trio behind HAProxy serving the streaming rag_pipeline v10 (tiers v10 > v14,
without the reranker and with the lighter llm 5), its streams read through HAProxy's gRPC
frontend, the LLM's first token slowed past its objective, then healed. And under a surge: users
through HAProxy's HTTP frontend, more than the trio serves in its budget, until the automation
finds the pool over it (or saturated) and steps it down (tiers v1 > v4).

Measurable: the first moment the trigger's own readings (the automation's queries, judged by
`triggers.judge`), polled by the bench every 0.1 s, say the budget is broken in both windows: the
windows' wait is the trigger's by design. Reaction: from then to every node read back serving v4
(its repository index, polled every 0.1 s); target under 2 s, asserted on the median.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_degradation_reaction.py -s -p no:cacheprovider`
"""

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.degradation import automation
from apps.degradation.models import Tiers
from apps.degradation.services import tier_serve, tiers_set
from apps.degradation.triggers import judge
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.devtools.traffic import QUESTIONS
from apps.fleet.models import Deployment, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.triton import TritonClient, TritonError, sample_inputs
from apps.incidents.models import Incident
from apps.registry.services import model_set_budget, model_set_slo
from tests.support.bench import Report
from tests.support.fleet import (
    STEPS_V1,
    STEPS_V2,
    converged,
    flapping,
    ready_on,
    settled,
    traffic_to,
    wait_for,
)
from tests.support.services import Celery

ROUNDS = 3
TARGET_S = 2.0
POLL_S = 0.1
BUDGET_MS = 250
SHORT_S, LONG_S = 4, 10  # the worker's, tests/support/services.py
MIN_REQUESTS = 5  # the worker's too
TTFT_MS = 300  # llm 1's first tokens come within about 110 ms; slowed by SLOWER_MS, not
SLOWER_MS = 400
STEPS_V10 = {("embedder", 2), ("retriever", 2), ("reranker", 2), ("llm", 1), ("rag_pipeline", 10)}
STANDING_BY = {("llm", 5)}  # v14's steps that v10 lacks, loaded unserved
V4_STANDING_BY = {("embedder", 2), ("retriever", 2), ("generator", 2)}  # beside v1
SURGE_USERS = 36  # each sending one request after the other: 12 a node, P99 about 250 ms
SURGE_BUDGET_MS = 200


def breached(tiers: Tiers) -> bool:
    """The automation's own judgement of the pipeline as it serves now, with its worker's
    minimum of requests (the test's `settings`)."""
    serving = Deployment.objects.get(pool=tiers.pool, model=tiers.model).version
    steps = automation._steps(tiers, serving)
    nodes = [node.name for node in tiers.pool.nodes.in_traffic()]
    short, long = (automation._window(tiers, steps, nodes, window) for window in (SHORT_S, LONG_S))
    return judge(short, long, automation._limits(tiers.model, steps)).breached


def one_breach(pool: NodePool, devfleet: Devfleet, tiers: Tiers) -> float:
    """The reranker slowed until every node serves v4: seconds from measurable to served."""
    deadline = time.monotonic() + 120
    devfleet.fault("reranker", delay_ms=400)
    try:
        while not breached(tiers):
            assert time.monotonic() < deadline, "the breach never became measurable"
            time.sleep(POLL_S)
        measurable = time.monotonic()
        nodes = list(pool.nodes.all())
        while not all(("rag_pipeline", 4) in ready_on(node) for node in nodes):
            assert time.monotonic() < deadline, "the pool never stepped down"
            time.sleep(POLL_S)
        return time.monotonic() - measurable
    finally:
        devfleet.fault("reranker")


@pytest.fixture
def tiers(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery, settings: object
) -> Tiers:
    """The pool on v2, tiers v2 > v4, a budget of BUDGET_MS; the worker reads the trio's
    Prometheus."""
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    settings.PROMETHEUS_URL = state.prometheus_url  # type: ignore[attr-defined]
    settings.DEGRADATION_MIN_REQUESTS = MIN_REQUESTS  # type: ignore[attr-defined]
    deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor="system:bench")
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=BUDGET_MS, actor="sre")
    return tiers_set(pool_name=pool.name, model_name="rag_pipeline", versions=[2, 4], actor="rm")


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_breach_steps_every_node_down_within_2_s_of_being_measurable(
    pool: NodePool, trio: tuple[Devfleet, FleetState], tiers: Tiers, report: Report
) -> None:
    began = time.perf_counter()
    devfleet, state = trio
    reactions = []
    with traffic_to(state):
        for _ in range(ROUNDS):
            tier_serve(tiers, 0, "system:bench")
            wait_for("v2 on every node", converged(pool, STEPS_V2), timeout=120)
            # Triton's P99 summaries keep a request 60 s: the round before must be forgotten.
            wait_for("the budget held", lambda: not breached(tiers), timeout=120)
            Tiers.objects.filter(pk=tiers.pk).update(switched_at=[], judged_from=None)
            reactions.append(one_breach(pool, devfleet, tiers))
            print(f"\nbreach measurable -> every node on v4: {reactions[-1]:.2f} s")
    bench = f"degradation on a budget breach (trio, {ROUNDS} rounds)"
    report.add(
        bench,
        "breach measurable -> every node serving the lower tier, median",
        f"{statistics.median(reactions):.2f} s ({', '.join(f'{r:.2f}' for r in reactions)})",
        f"< {TARGET_S:g} s",
    )
    report.add(bench, "bench runtime (trio start excluded)", f"{time.perf_counter() - began:.0f} s")
    assert statistics.median(reactions) < TARGET_S


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_fault_flapping_for_5_minutes_switches_twice_then_freezes(
    pool: NodePool, trio: tuple[Devfleet, FleetState], tiers: Tiers, report: Report
) -> None:
    """The reranker slow for 20 s, fine for 20 s, for the whole 5 minutes (CI's integration test
    stops one cycle after the freeze): one step down, one back up, then a freeze and a critical
    incident; never a switch per cycle."""
    devfleet, state = trio
    with traffic_to(state):
        wait_for("v2 on every node", converged(pool, STEPS_V2), timeout=120)
        wait_for("the budget held", lambda: not breached(tiers), timeout=120)
        for _ in flapping(devfleet, "reranker", seconds=300):
            pass
    moves = AuditEvent.objects.filter(action__in=["pool.degrade", "pool.restore"])
    switches = list(moves.order_by("id").values_list("action", flat=True))
    frozen = Tiers.objects.get(pk=tiers.pk).frozen_at
    incident = Incident.objects.filter(pool=pool, severity=Incident.Severity.CRITICAL).first()
    report.add(
        "degradation under a flapping fault (trio, 20 s slow / 20 s fine, 5 min)",
        "switches, then",
        f"{len(switches)}, {'frozen' if frozen else 'not frozen'}",
        "at most 2, then frozen",
    )
    assert switches == ["pool.degrade", "pool.restore"] and frozen is not None
    assert incident is not None and incident.status == Incident.Status.OPEN


@contextmanager
def surge(url: str, users: int) -> Iterator[Counter[str]]:
    """`users` sending unversioned rag_pipeline requests to `url` one after the other while it
    lasts; yields their outcomes so far (`ok`, `failed`)."""
    spec = TritonClient(url, node="balancer").model_inputs("rag_pipeline")
    stop, outcomes = threading.Event(), Counter[str]()

    def user(seed: int) -> None:
        rng = random.Random(seed)
        with TritonClient(url, node="balancer").session(timeout=60) as session:
            while not stop.is_set():
                try:
                    session.infer("rag_pipeline", sample_inputs(spec, rng, texts=QUESTIONS))
                    outcomes["ok"] += 1
                except (TritonError, OSError):
                    outcomes["failed"] += 1
                    stop.wait(0.2)

    threads = [threading.Thread(target=user, args=(n,), daemon=True) for n in range(users)]
    for thread in threads:
        thread.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for thread in threads:
            thread.join(70)


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_surge_through_haproxy_steps_every_node_down_within_2_s_of_the_decision(
    weighted: NodePool, haproxy: Proc, report: Report
) -> None:
    pool = weighted  # serving v1, behind HAProxy
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=SURGE_BUDGET_MS, actor="sre")
    tiers = tiers_set(pool_name=pool.name, model_name="rag_pipeline", versions=[1, 4], actor="rm")
    wait_for("v1 served, v4's steps standing by", settled(pool, STEPS_V1 | V4_STANDING_BY))
    on_v4 = lambda: all(("rag_pipeline", 4) in ready_on(node) for node in pool.nodes.all())  # noqa: E731
    switched = Tiers.objects.filter(pk=tiers.pk).values_list("switched_at", flat=True)
    with surge(f"http://127.0.0.1:{haproxy.ports['http']}", SURGE_USERS) as outcomes:
        try:
            wait_for("the automation steps down", lambda: bool(switched.get()), interval=POLL_S)
        finally:
            print(f"\n{Tiers.objects.get(pk=tiers.pk).said}; {outcomes}")
        wait_for("every node on v4", on_v4, timeout=60, interval=POLL_S)
        served = timezone.now()
    decided = datetime.fromisoformat(switched.get()[0])
    took = (served - decided).total_seconds()
    bench = f"degradation under a surge (trio behind HAProxy, {SURGE_USERS} users, tiers v1 > v4)"
    report.add(bench, "decision -> every node serving the lower tier", f"{took:.2f} s", "< 2 s")
    report.add(bench, "requests failed", f"{outcomes['failed']} of {sum(outcomes.values())}", "0")
    assert took < TARGET_S and AuditEvent.objects.filter(action="pool.degrade").count() == 1


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_slower_first_token_steps_every_node_to_the_lighter_llm_within_2_s_and_back_once(
    weighted: NodePool,
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    report: Report,
    settings: object,
) -> None:
    devfleet, state = trio
    pool = weighted
    settings.DEGRADATION_MIN_REQUESTS = MIN_REQUESTS  # type: ignore[attr-defined]
    deployment_set(model_name="rag_pipeline", version=10, pool=pool, actor="system:bench")
    model_set_slo(
        model_name="llm", availability=None, latency=None, ttft=(0.99, TTFT_MS), actor="sre"
    )
    tiers = tiers_set(pool_name=pool.name, model_name="rag_pipeline", versions=[10, 14], actor="rm")
    wait_for("v10 served, llm 5 standing by", settled(pool, STEPS_V10 | STANDING_BY), timeout=240)
    on_v14 = lambda: all(("rag_pipeline", 14) in ready_on(node) for node in pool.nodes.all())  # noqa: E731
    with traffic_to(state, balancer=haproxy, rps=8) as outcomes:
        wait_for("first tokens within their objective", lambda: not breached(tiers))
        devfleet.fault("llm", delay_ms=SLOWER_MS)
        try:
            wait_for(
                "the slower first token measurable",
                lambda: breached(tiers),
                interval=POLL_S,
            )
            measurable = time.monotonic()
            wait_for("every node on v14", on_v14, timeout=60, interval=POLL_S)
            reaction = time.monotonic() - measurable
        finally:
            devfleet.fault("llm")
        back = settled(pool, STEPS_V10 | STANDING_BY)
        wait_for("back on v10 once healed", back, timeout=400, interval=1)
    moves = AuditEvent.objects.filter(action__in=["pool.degrade", "pool.restore"])
    switches = list(moves.order_by("id").values_list("action", flat=True))
    failed = sum(n for outcome, n in outcomes.items() if outcome.endswith("failed"))
    bench = "degradation on the first token (trio behind HAProxy, streams, tiers v10 > v14)"
    report.add(
        bench,
        "first token breach measurable -> every node on v14",
        f"{reaction:.2f} s",
        f"< {TARGET_S:g} s",
    )
    report.add(bench, "switches, down and back", ", ".join(switches), "pool.degrade, pool.restore")
    report.add(bench, "streams failed", f"{failed} of {sum(outcomes.values())}", "0")
    assert reaction < TARGET_S and switches == ["pool.degrade", "pool.restore"]
