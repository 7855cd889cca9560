"""perf_analyzer's report read, and what an unreadable one says; its ranges and inputs; the
performance gate's verdict from stored runs, its refusals, and its figures on the rollout page
and in the API (the runs themselves, against real nodes: tests/integration/test_performance.py)."""

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.accounts.services import token_create
from apps.fleet.models import Deployment, Node, NodePool
from apps.performance.analyzer import PerfError, Point, _points, concurrency_range, input_data
from apps.performance.models import PerfRun
from apps.performance.selectors import capacities
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout, Round
from apps.rollouts.perf_gate import perf_results
from apps.rollouts.plans import Analysis, PlanError
from apps.rollouts.proposals import RolloutError, rollout_propose
from apps.rollouts.transitions import record
from apps.rollouts.verdicts import Verdict
from tests.support.quality import demo_faq, perf_gate_runs

HEADER = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
    "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
    "p50 latency,p90 latency,p95 latency,p99 latency"
)


def test_a_report_reads_as_one_point_per_concurrency_in_milliseconds() -> None:
    text = f"{HEADER}\n2,812.5,10,200,150,20,900,30,5,2100,2600,2800,3900\n"
    assert _points(text, "n1: embedder v1") == [
        # Two users, each request 1,315 us on average: 1,520.9 a second.
        Point(2, 2 / 0.001315, p50_ms=2.1, p90_ms=2.6, p99_ms=3.9, queue_us=150.0, compute_us=950.0)
    ]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "n1: embedder v1: perf_analyzer reported no measurement"),
        (f"{HEADER}\n", "n1: embedder v1: perf_analyzer reported no measurement"),
        ("Concurrency,Inferences/Second\n1,812\n", "report is not as expected: 'Client Send'"),
        (f"{HEADER}\n1,0,0,0,0,0,0,0,0,1,1,1,1\n", "not as expected: a mean latency of 0 us"),
        (f"{HEADER}\n1,812,fast,1,1,1,1,1,1,1,1,1,1\n", "not as expected: could not convert"),
    ],
)
def test_an_unreadable_report_says_so(text: str, said: str) -> None:
    with pytest.raises(PerfError, match=said):
        _points(text, "n1: embedder v1")


def test_a_concurrency_range_reads_as_perf_analyzer_writes_it_and_is_bounded() -> None:
    assert concurrency_range("4", 60) == (4, 4, 1)
    assert concurrency_range(" 1:4 ", 60) == (1, 4, 1)
    assert concurrency_range("2:8:2", 60) == (2, 8, 2)
    for text, said in [
        ("x", "'x' is not a concurrency range such as 4, 1:4 or 2:8:2"),
        ("1:2:3:4", "is not a concurrency range"),
        ("0", "'0': from 1 up, 8 concurrencies at most"),
        ("4:1", "'4:1': from 1 up"),
        ("1:9", "'1:9': from 1 up, 8 concurrencies at most"),
        ("1:8", "'1:8': 8 concurrencies of up to 120 s each may take longer than a measurement's"),
    ]:
        with pytest.raises(PerfError, match=re.escape(said)):
            concurrency_range(text, 120)


def test_stored_requests_become_perf_analyzers_input_data_without_the_batch_dimension() -> None:
    stored = [{"QUESTION": {"datatype": "BYTES", "shape": [1, 1], "data": ["track my order"]}}]
    assert input_data(stored, batched=True) == {
        "data": [{"QUESTION": {"content": ["track my order"], "shape": [1]}}]
    }
    assert input_data(stored, batched=False)["data"][0]["QUESTION"]["shape"] == [1, 1]


# The performance gate's verdict, its refusals, and the rollout page -----------------------------


@pytest.fixture
def gated(db: None) -> Rollout:
    """rag_pipeline v15 -> v16 on the trio, its performance gate measuring."""
    demo_faq()
    pool = NodePool.objects.create(name="trio")
    Node.objects.create(name="trio-1", pool=pool, http_url="http://10.0.0.1:8000")
    return Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        baseline_version=15,
        canary_version=16,
        plan=[{"nodes": 1, "hold_s": 60}, {"percent": 100}],
        analysis={"perf_concurrency": "4", "perf_requests": 120},
        canary_nodes=["trio-1"],
        started_by="release_manager-user",
    )


SLOWER = [(16, 25.5, 170.0), (15, 50.2, 90.0), (15, 49.0, 92.0), (16, 24.9, 168.0)]


def test_the_gate_fails_a_canary_beyond_its_tolerances_at_a_concurrency(gated: Rollout) -> None:
    found = perf_results(perf_gate_runs(gated, SLOWER), Analysis.from_dict(gated.analysis))
    rate, p99 = found
    assert (rate.metric, rate.kind, rate.verdict) == (
        "throughput at concurrency 4",
        "throughput",
        "failure",
    )
    assert (rate.canary, rate.baseline) == (25.2, 49.6)
    assert rate.threshold == pytest.approx(49.6 * 0.9)
    assert rate.detail == (
        "at concurrency 4, the canary served 25.2 requests a second, the baseline 49.6: more "
        "than 10% fewer"
    )
    assert (p99.metric, p99.kind, p99.verdict) == ("P99 at concurrency 4", "latency", "failure")
    assert p99.threshold == pytest.approx(92.0 * 1.25)  # of the baseline's slower run
    assert p99.detail == (
        "at concurrency 4, the canary's P99 was 168.0 ms in its faster run, the baseline's 92.0 "
        "in its slower: above 115.0"
    )
    assert p99.query == (
        "perf_analyzer on trio-1: rag_pipeline v16 against v15, 120 requests a run at each "
        "concurrency"
    )


def test_a_canary_within_its_tolerances_passes_and_a_few_ms_are_noise(gated: Rollout) -> None:
    spec = Analysis.from_dict(gated.analysis)
    alike = [(16, 48.0, 3.0), (15, 50.0, 2.0), (15, 50.0, 2.0), (16, 47.0, 6.0)]
    assert {r.verdict for r in perf_results(perf_gate_runs(gated, alike), spec)} == {"success"}
    # One of its runs stalled (its P99 is its slowest two requests of 120), the other as fast
    # as the baseline: no slower P99 shown.
    stalled = [(16, 48.0, 140.0), (15, 50.0, 88.0), (15, 50.0, 90.0), (16, 47.0, 91.0)]
    rate, p99 = perf_results(perf_gate_runs(gated, stalled), spec)
    assert (rate.verdict, p99.verdict, p99.canary) == ("success", "success", 115.5)


def test_a_pool_without_a_balancer_has_no_gate_before_traffic(gated: Rollout) -> None:
    ModelVersion.objects.filter(model__name="rag_pipeline").update(status="published")
    Deployment.objects.create(model=gated.model, pool=gated.pool, version=1)
    asked = {"model_name": "rag_pipeline", "pool_name": "trio", "canary_version": 2}
    with pytest.raises(
        RolloutError,
        match=re.escape(
            "the performance gate needs the canary drained while it is measured, and pool trio has "
            "no balancer to hold its traffic back (perf_concurrency)"
        ),
    ):
        rollout_propose(**asked, plan="1 node\n100%", analysis={"perf_concurrency": "4"})
    with pytest.raises(RolloutError, match="a blue-green release has none"):
        rollout_propose(
            **asked, plan="100%", analysis={"perf_concurrency": "4"}, strategy="blue_green"
        )
    with pytest.raises(PlanError, match=re.escape("analysis.perf_concurrency: '0': from 1 up")):
        rollout_propose(**asked, plan="1 node\n100%", analysis={"perf_concurrency": "0"})


def test_a_template_with_the_gate_is_looser_without_it() -> None:
    template = Analysis.from_dict({"perf_concurrency": "4", "perf_throughput_tolerance": 0.1})
    mine = Analysis.from_dict({"perf_throughput_tolerance": 0.3})
    assert mine.looser_than(template) == [
        "performance gate at concurrency 'none', not '4'",
        "perf_throughput_tolerance 0.3, the template's 0.1",
    ]


def test_the_rollout_page_draws_the_gates_runs_and_its_verdict(
    gated: Rollout, client: Client, viewer: User
) -> None:
    runs = perf_gate_runs(gated, SLOWER)
    found = perf_results(runs, Analysis.from_dict(gated.analysis))
    record(gated, found, Verdict.FAILURE, Round.Kind.PERF)
    client.force_login(viewer)
    body = client.get(f"/rollouts/{gated.pk}/").content.decode()
    assert '<section class="card quality-gate" id="perf-gate">' in body
    assert 'id="perf-verdict">failure</span>' in body
    assert "the canary served 25.2 requests a second, the baseline 49.6" in body
    assert f'<td rowspan="1">#{runs[0].pk}</td><td rowspan="1">v16</td>' in body
    assert "<td>4</td><td>25.5</td><td>85.00</td><td>136.00</td><td>170.00</td>" in body
    assert 'data-figure-id="perf-curves"' in body and "P99 against throughput" in body
    assert "<summary>perf_analyzer</summary>" in body
    _, token = token_create(user=viewer, name="pipeline", actor="system:test")
    auth = {"Authorization": f"Bearer {token}"}
    answer = client.get(f"/api/rollouts/{gated.pk}", headers=auth).json()
    assert answer["perf"]["verdict"] == "failure"
    assert [r["version"] for r in answer["perf"]["runs"]] == [16, 15, 15, 16]
    assert answer["perf"]["runs"][0]["points"][0]["throughput"] == 25.5


# Capacity from evidence ------------------------------------------------------------------------


def test_a_versions_capacity_is_its_newest_runs_best_concurrency_within_the_budget(
    gated: Rollout,
) -> None:
    Model.objects.filter(name="rag_pipeline").update(latency_budget_ms=150)
    _, newer = perf_gate_runs(gated, [(15, 80.0, 60.0), (15, 50.2, 90.0)])  # the newer counts
    newer.points.create(
        concurrency=8,
        throughput=60.0,
        p50_ms=120,
        p90_ms=150,
        p99_ms=170,
        queue_us=0,
        compute_us=0,
    )  # more requests a second, over the budget at P99
    perf_gate_runs(gated, [(16, 25.5, 170.0)])
    PerfRun.objects.filter(version=16).update(status=PerfRun.Status.FAILED)
    found = capacities([("rag_pipeline", 15), ("rag_pipeline", 16), ("rag_pipeline", 99)])
    assert list(found) == [("rag_pipeline", 15)]  # a failed run measures nothing
    capacity = found[("rag_pipeline", 15)]
    assert (capacity.run, capacity.per_node, capacity.concurrency) == (newer.pk, 50.2, 4)
    assert (capacity.p99_ms, capacity.budget_ms, capacity.node) == (90.0, 150, "trio-1")
    assert [capacity.nodes_for(rate) for rate in (0, 30, 50.2, 120)] == [0, 1, 1, 3]
    Model.objects.filter(name="rag_pipeline").update(latency_budget_ms=50)
    over = capacities([("rag_pipeline", 15)])[("rag_pipeline", 15)]
    assert over.per_node is None and over.nodes_for(30) is None


def test_the_pools_throughput_says_the_nodes_its_request_rate_needs(
    gated: Rollout, client: Client, viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    Deployment.objects.create(model=gated.model, pool=gated.pool, version=15)
    perf_gate_runs(gated, [(15, 50.2, 90.0)])
    asked: list[str] = []

    def rates(query: str) -> list[tuple[dict[str, str], float]]:
        asked.append(query)
        return [({"model": "rag_pipeline"}, 120.4)]

    monkeypatch.setattr("apps.performance.views.instant_query", rates)
    client.force_login(viewer)
    body = client.get("/pools/trio/throughput/").content.decode()
    assert asked == ['sum by (model) (rate(nv_inference_request_success{pool="trio"}[5m]))']
    assert "<td>rag_pipeline v15</td>" in body and "50.2/s" in body and "at 4 users" in body
    assert "<td>120.4</td>" in body and "<strong>3</strong>" in body

    def down(query: str) -> list[tuple[dict[str, str], float]]:
        raise PrometheusUnavailable("Prometheus at http://127.0.0.1:1 did not answer")

    monkeypatch.setattr("apps.performance.views.instant_query", down)
    body = client.get("/pools/trio/throughput/").content.decode()
    assert "The request rate is unknown: Prometheus at http://127.0.0.1:1 did not answer" in body
    assert "50.2/s" in body and "request rate unknown" in body
