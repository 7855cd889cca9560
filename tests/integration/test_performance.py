"""perf_analyzer against real Triton nodes, and the performance gate on 3 of them behind a real
HAProxy.

perf_analyzer measures a version at each concurrency of a range, its figures as it reports them;
Triton's own request counter for that version reads back exactly the requests it was told to
send, and its throughput is what Triton counted over the same run. A binary that is missing, a
node that does not answer, a run out of time: a PerfError that says which node and model, and
why. The gate stops a release as fast alone but slower under load before a single user request
reaches it, passes a healthy one, and pauses, never passes, where it cannot measure; what it
measured says how many nodes the pool's request rate needs. A search of the reranker's config,
on a node held out of traffic, finds the instances its tuning release then passes the gate with."""

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.triton import TritonClient
from apps.performance.analyzer import PerfError, perf_measure
from apps.performance.models import PerfRun, PerfSearch
from apps.performance.services import search_start
from apps.quality.services import evaluation_set_import
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import rollout_abort, rollout_resume
from apps.rollouts.tuning import search_advice, tuning_start
from tests.support.fleet import (
    ANALYSIS,
    HEALTHY,
    STEPS_V15,
    counted,
    equal,
    served,
    settled,
    tick_until,
    traffic_to,
    wait_for,
    weights,
    with_perf_drills,
)
from tests.support.quality import DEMO_SET
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
REQUESTS = 300  # at each concurrency
State = Rollout.State
CANARY = "trio-1"  # the first node by name
# At 4 users, 120 requests a run, the reranker (40 ms a request) is what limits them: two
# instances 50 requests a second, one 25, whatever else shares the machine's cores. Tolerances
# wide enough for a machine shared with other tests, and narrower than the slower release's 50 %.
GATE = {
    "perf_concurrency": "4",
    "perf_requests": 120,
    "perf_throughput_tolerance": 0.2,
    "perf_p99_tolerance": 0.5,
}


@pytest.fixture(scope="module", autouse=True)
def drills(repository: Path) -> None:
    """Before the pool imports the repository: the performance gate's drills in it."""
    with_perf_drills(repository)


def _grpc(state: FleetState) -> str:
    return state.node_urls(state.nodes[0])["grpc_url"]


@pytest.fixture(scope="module")
def embedder(trio: tuple[Devfleet, FleetState]) -> FleetState:
    """The trio's first node serving embedder v1, loaded by hand (no product yet)."""
    devfleet, state = trio
    devfleet.load_release(TritonClient(state.node_urls(state.nodes[0])["http_url"]), "embedder", 1)
    return state


@pytest.mark.alone  # perf_analyzer at full speed: it measures the host
def test_perf_analyzer_measures_a_version_and_triton_counts_exactly_its_requests(
    embedder: FleetState,
) -> None:
    first = embedder.nodes[:1]
    before = served(first, embedder, "embedder")[1]
    points = perf_measure(
        grpc_url=_grpc(embedder),
        model="embedder",
        version=1,
        concurrencies=(1, 2, 1),
        requests=REQUESTS,
    )
    assert [p.concurrency for p in points] == [1, 2]
    for point in points:
        assert point.throughput > 0 and 0 < point.p50_ms <= point.p90_ms <= point.p99_ms
        assert point.compute_us > 0 and point.queue_us >= 0
    assert served(first, embedder, "embedder")[1] - before == 2 * REQUESTS


@pytest.mark.alone  # perf_analyzer at full speed: it measures the host
def test_its_throughput_is_what_triton_counted_over_the_same_run(embedder: FleetState) -> None:
    """Triton's statistics read every 10 ms while perf_analyzer runs: the requests it counted
    from the first to the last, over the time between them, within 5 % of perf_analyzer's."""
    url = f"{embedder.node_urls(embedder.nodes[0])['http_url']}/v2/models/embedder/versions/1/stats"
    readings: list[tuple[float, int]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a local node
                stats = json.load(response)["model_stats"][0]["inference_stats"]
            readings.append((time.monotonic(), stats["success"]["count"]))
            stop.wait(0.01)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for("a first reading", lambda: bool(readings))
        (point,) = perf_measure(
            grpc_url=_grpc(embedder),
            model="embedder",
            version=1,
            concurrencies=(2, 2, 1),
            requests=1500,
        )
        wait_for("the last request counted", lambda: readings[-1][1] - readings[0][1] >= 1500)
    finally:
        stop.set()
        reader.join(5)
    start = next(r for r in readings if r[1] > readings[0][1])  # its first requests counted
    end = next(r for r in readings if r[1] - readings[0][1] >= 1500)
    counted_rate = (end[1] - start[1]) / (end[0] - start[0])
    assert abs(point.throughput - counted_rate) / counted_rate < 0.05, (point, counted_rate)


@pytest.mark.alone  # perf_analyzer at full speed: it measures the host
def test_a_failed_missing_or_late_run_says_why(embedder: FleetState, settings: object) -> None:
    grpc_url = _grpc(embedder)
    asked = {"model": "embedder", "version": 1, "concurrencies": (1, 1, 1), "requests": 50}
    unknown = "perf-1: embedder v9: perf_analyzer failed: error: failed to get model metadata: "
    unknown += "Request for unknown model: 'embedder' version 9 is not found"
    with pytest.raises(PerfError, match=re.escape(unknown)):
        perf_measure(grpc_url=grpc_url, node="perf-1", **asked | {"version": 9})
    down = "127.0.0.1:1: embedder v1: perf_analyzer failed: error: failed to get model metadata"
    with pytest.raises(PerfError, match=re.escape(down) + ".*Connection refused"):
        perf_measure(grpc_url="127.0.0.1:1", **asked)
    with pytest.raises(PerfError, match=re.escape("did not finish in 0.05 s")):
        perf_measure(grpc_url=grpc_url, timeout_s=0.05, **asked)
    settings.PERF_ANALYZER = "/nowhere/perf_analyzer"  # type: ignore[attr-defined]
    with pytest.raises(PerfError, match="no perf_analyzer at '/nowhere/perf_analyzer'"):
        perf_measure(grpc_url=grpc_url, **asked)


# The gate ------------------------------------------------------------------------------------


@pytest.fixture
def on_v15(weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]) -> NodePool:
    """The weighted trio serving rag_pipeline v15 (its reranker: two instances, 40 ms a
    request), every node back in traffic; the pipeline's own inputs in the registry."""
    text = DEMO_SET.read_text()
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ci")
    deployment_set(model_name="rag_pipeline", version=15, pool=weighted, actor="system:test")
    on_it = settled(weighted, STEPS_V15)
    back = lambda: on_it() and weights(haproxy) == equal(trio[1])  # noqa: E731
    wait_for("v15 on every node, back in traffic", back, timeout=240)
    return weighted


def start(pool: NodePool, canary: int, **analysis: object) -> Rollout:
    return rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=canary,
        plan="33%, hold 10m\n100%",
        analysis={**ANALYSIS, **HEALTHY, **GATE, **analysis},
        actor="release-manager",
    )


@pytest.mark.timeout(600)  # two releases gated, each measured four times
def test_a_release_slower_under_load_is_stopped_before_any_traffic_a_healthy_one_passes(
    on_v15: NodePool,
    haproxy: Proc,
    trio: tuple[Devfleet, FleetState],
    celery: Celery,
    client: Client,
    viewer: User,
) -> None:
    _, state = trio
    canary = [proc for proc in state.nodes if proc.name == CANARY]
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    with celery.holding_rollouts(), traffic_to(state, through=balancer, rps=10):
        slower = start(on_v15, canary=16)  # reranker v8: one instance where v7 has two
        runs = PerfRun.objects.filter(purpose__startswith=f"rollout #{slower.pk},")
        done = runs.filter(status=PerfRun.Status.DONE)
        # Between two ticks nothing else moves: each side's counter on Triton (a version's
        # counts start again at each load) holds the gate's requests, and no user's.
        for number, version, expected in [(1, 16, 120), (3, 15, 240), (4, 16, 120)]:
            tick_until(f"run {number} starts", slower, lambda n=number: runs.count() == n, 240)
            wait_for(f"run {number} measured", lambda n=number: done.count() == n)
            answered = counted(canary, state, "rag_pipeline", version, expected)
            assert answered[version] == expected, (number, answered)
        current = lambda: Rollout.objects.get(pk=slower.pk)  # noqa: E731
        judged = lambda: current().perf_passed_at or current().state != State.PROGRESSING  # noqa: E731
        tick_until("judged", slower, judged)
        assert current().reason.startswith(
            "performance gate failed before any traffic: at concurrency 4, the canary served "
        ), (current().state, current().reason)
        tick_until("rolled back", slower, lambda: current().state == State.ROLLED_BACK)
    assert [(r.version, r.status, r.node_name) for r in runs.order_by("id")] == [
        (16, "done", CANARY),
        (15, "done", CANARY),
        (15, "done", CANARY),
        (16, "done", CANARY),
    ]
    rate = Measurement.objects.get(rollout=slower, metric="throughput at concurrency 4")
    assert (rate.round.kind, rate.round.verdict, rate.verdict) == ("perf", "failure", "failure")
    assert rate.canary_value < 0.7 * rate.baseline_value, (rate.canary_value, rate.baseline_value)
    assert rate.evidence == {"runs": [r.pk for r in runs.order_by("id")]}

    wait_for("v15 alone again", settled(on_v15, STEPS_V15), timeout=120)
    with traffic_to(state, through=balancer, rps=10):
        healthy = start(on_v15, canary=17)  # the same steps as v15
        current = lambda: Rollout.objects.get(pk=healthy.pk)  # noqa: E731
        wait_for("the gate passed", lambda: current().perf_passed_at is not None, timeout=240)
        rate = Measurement.objects.get(rollout=healthy, metric="throughput at concurrency 4")
        assert (rate.round.verdict, rate.verdict) == ("success", "success")
        wait_for("the canary takes its share", lambda: bool((weights(haproxy) or {}).get(CANARY)))
        # The pool's capacity: v15 as the gate measured it, against the rate Prometheus reads.
        client.force_login(viewer)
        body = client.get("/pools/trio/throughput/").content.decode()
        assert "<td>rag_pipeline v15</td>" in body and "at 4 users" in body, body
        assert "<strong>1</strong>" in body, body  # 10 requests a second: one node's worth
        rollout_abort(rollout_id=healthy.pk, actor="release-manager")
        wait_for("rolled back", lambda: current().state == State.ROLLED_BACK, timeout=120)


def test_a_gate_that_cannot_measure_pauses_and_never_passes(
    on_v15: NodePool, haproxy: Proc, celery: Celery
) -> None:
    celery.use_env(PERF_ANALYZER="/nowhere/perf_analyzer")
    try:
        rollout = start(on_v15, canary=17)
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        wait_for("paused", lambda: current().state == State.PAUSED, timeout=180)
    finally:
        celery.use_env(PERF_ANALYZER=None)
    assert current().reason == (
        "performance gate: trio-1: rag_pipeline v17: no perf_analyzer at "
        "'/nowhere/perf_analyzer'; resume to run it again"
    )
    assert (weights(haproxy) or {}).get(CANARY) == 0 and current().perf_passed_at is None
    # Resumed with a perf_analyzer that takes longer than the run may: paused again.
    Rollout.objects.filter(pk=rollout.pk).update(
        analysis={**current().analysis, "perf_requests": 5000, "perf_timeout_s": 2}
    )
    rollout_resume(rollout_id=rollout.pk, actor="release-manager")
    wait_for("paused again", lambda: current().state == State.PAUSED, timeout=180)
    assert current().reason == (
        "performance gate: trio-1: rag_pipeline v17: perf_analyzer did not finish in 2 s; "
        "resume to run it again"
    )
    assert (weights(haproxy) or {}).get(CANARY) == 0 and current().perf_passed_at is None
    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    wait_for("rolled back", lambda: current().state == State.ROLLED_BACK, timeout=120)


# The search (last in the module: its tuning adds versions to the module's repository) ----------


@pytest.mark.timeout(600)  # a search of four configurations, then a release gated before traffic
def test_a_search_finds_the_reranker_instances_that_its_tuning_release_confirms(
    on_v15: NodePool,
    haproxy: Proc,
    trio: tuple[Devfleet, FleetState],
    repository: Path,
    settings: object,
) -> None:
    _, state = trio
    settings.REGISTRY_ARTIFACT_ROOTS = [str(repository)]  # type: ignore[attr-defined]
    deployment_set(model_name="rag_pipeline", version=16, pool=on_v15, actor="system:test")
    v16 = STEPS_V15 - {("reranker", 7), ("rag_pipeline", 15)} | {
        ("reranker", 8),
        ("rag_pipeline", 16),
    }
    back = lambda: settled(on_v15, v16)() and weights(haproxy) == equal(state)  # noqa: E731
    wait_for("v16 on every node, back in traffic", back, timeout=240)
    # The reranker (40 ms a request, one instance, no batching) is what limits 4 users.
    search = search_start(
        pipeline="rag_pipeline",
        pool_name="trio",
        step="reranker",
        concurrency=4,
        requests=120,
        actor="release-manager",
    )
    current = lambda: PerfSearch.objects.get(pk=search.pk)  # noqa: E731
    wait_for("the search ends", lambda: current().finished, timeout=300)
    search = current()
    assert search.status == PerfSearch.Status.DONE, search.error
    trials = list(search.trials.order_by("id"))
    labels = [t.label for t in trials]
    assert labels[:3] == ["1 instance, batch 8", "2 instances, batch 8", "4 instances, batch 8"]
    assert all(t.error == "" for t in trials), [t.error for t in trials]
    winner, first = search.winner, trials[0]
    assert winner is not None and winner.fields["instance_group"][0]["count"] >= 2
    assert winner.throughput > 1.5 * first.throughput, (winner.throughput, first.throughput)
    # Each trial a load on the node, read back; the reranker loaded back as it was; the node in
    # traffic again.
    node = Node.objects.get(name=search.node_name)
    loads = list(node.operations.filter(requested_by=f"search #{search.pk}").order_by("id"))
    assert [op.status for op in loads] == ["succeeded"] * (len(trials) + 1)
    before = node.operations.exclude(requested_by=f"search #{search.pk}")
    served = before.filter(model_name="reranker", status="succeeded").order_by("id").last()
    assert served is not None and loads[-1].config_digest == served.config_digest
    config = TritonClient(
        state.node_urls(next(p for p in state.nodes if p.name == node.name))["http_url"]
    ).model_config("reranker")
    assert config["instance_group"][0]["count"] == 1
    assert weights(haproxy) == equal(state)
    # Released as a tuning rollout, gated before traffic: the tuned reranker serves more at
    # concurrency 4 than the one it tunes, at no worse P99.
    _, advice = search_advice(search.pk)
    rollout = tuning_start(
        pipeline="rag_pipeline",
        pool_name="trio",
        advice=advice,
        plan="33%, hold 10m\n100%",
        analysis={**ANALYSIS, **HEALTHY, **GATE},
        actor="release-manager",
    )
    current_rollout = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
    passed = lambda: current_rollout().perf_passed_at is not None  # noqa: E731
    wait_for("the gate passed", passed, timeout=240)
    rate = Measurement.objects.get(rollout=rollout, metric="throughput at concurrency 4")
    p99 = Measurement.objects.get(rollout=rollout, metric="P99 at concurrency 4")
    assert rate.canary_value > 1.3 * rate.baseline_value, (rate.canary_value, rate.baseline_value)
    assert p99.canary_value <= p99.baseline_value, (p99.canary_value, p99.baseline_value)
    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    wait_for("rolled back", lambda: current_rollout().state == State.ROLLED_BACK, timeout=120)
