"""The nodes each pool needs: the formula (the most any reading asks for, within bounds; held
without evidence; never a scale-in while a release runs; a pin over all), an HPA's arithmetic on
the exported series, the tick against stubbed Prometheus answers (tests/integration has a real
one), the page and who may pin or bound it."""

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, Node, NodePool
from apps.performance.models import PerfSearch
from apps.performance.search import search_lost_after
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.scaling import hpa, selectors, services
from apps.scaling.models import Scaling
from apps.scaling.selectors import scale_in_order
from apps.scaling.services import ScalingError, scaling_pin, scaling_set, scaling_tick
from apps.scaling.signal import Bounds, Load, Reading, Targets, nodes_wanted
from tests.support.metrics import matching, scrape, scrape_headers
from tests.support.quality import perf_measured
from tests.support.users import bearer, make_user

TARGETS = Targets(load=0.8, queue_ratio=1.0, gpu=0.7)
Series = list[tuple[dict[str, str], float]]


# The formula ----------------------------------------------------------------------------------


def test_the_most_any_reading_asks_for_wins_and_each_says_why() -> None:
    reading = Reading(
        loads=[Load("rag_pipeline v3", rate=40.0, per_node=10.0, run=7)],
        queue=("reranker", 2.0),
        gpu=0.5,
    )
    signal = nodes_wanted(nodes=3, serving=3, reading=reading, targets=TARGETS)
    assert signal.wanted == 6  # the queue: 3 x 2.0; the load asks 40 / (10 x 0.8) = 5
    load, queue, gpu = signal.reasons
    assert "rag_pipeline v3 40.0/s of 10.0 a node (run 7)" in load and load.endswith("5 nodes")
    assert "reranker waits 2.00x" in queue and queue.endswith("6 nodes")
    assert "GPU: 50% busy on 3 nodes" in gpu and gpu.endswith("3 nodes")  # 3 x 0.5 / 0.7
    assert signal.held == ""


def test_several_releases_add_up_and_an_unmeasured_one_says_it_is_not_counted() -> None:
    reading = Reading(
        loads=[
            Load("rag_pipeline v3", rate=12.0, per_node=10.0, run=7),
            Load("embedder v2", rate=30.0, per_node=50.0, run=8),
            Load("llm v1", rate=5.0, per_node=None),
        ]
    )
    signal = nodes_wanted(nodes=1, serving=1, reading=reading, targets=TARGETS)
    assert signal.wanted == 3  # (1.2 + 0.6) / 0.8 = 2.25 nodes' worth
    assert signal.reasons[1] == "no capacity measured of llm v1: load not counted"


def test_a_reading_within_the_tolerance_of_its_target_keeps_the_nodes_in_traffic() -> None:
    near = nodes_wanted(nodes=4, serving=4, reading=Reading(queue=("r", 1.08)), targets=TARGETS)
    far = nodes_wanted(nodes=4, serving=4, reading=Reading(queue=("r", 0.2)), targets=TARGETS)
    assert (near.wanted, far.wanted) == (4, 1)


def test_without_evidence_the_signal_holds_at_the_nodes_the_pool_has() -> None:
    away = Reading(unavailable="Prometheus at http://p:9090 did not answer: connection failed.")
    for reading, why in [
        (away, "did not answer"),
        (Reading(), "no request series of the pool"),
        (Reading(loads=[Load("llm v1", rate=5.0, per_node=None)]), "no request series"),
    ]:
        signal = nodes_wanted(nodes=7, serving=7, reading=reading, targets=TARGETS)
        assert signal.wanted == 7
        assert why in signal.reasons[0] and "held at its 7 nodes" in signal.reasons[0]
    kept = nodes_wanted(nodes=7, serving=7, reading=away, targets=TARGETS, last=9)
    assert kept.wanted == 9 and kept.reasons[0].endswith("keeps the 9 nodes it last asked for")
    # Nodes out of traffic carried none of the load read: no proportional ask from them.
    idle = nodes_wanted(nodes=2, serving=0, reading=Reading(queue=("r", 3.0)), targets=TARGETS)
    assert idle.wanted == 2


def test_bounds_clip_it_and_say_so() -> None:
    reading = Reading(queue=("r", 0.0))
    low = nodes_wanted(nodes=5, serving=5, reading=reading, targets=TARGETS, bounds=Bounds(least=2))
    assert (low.wanted, low.reasons[-1]) == (2, "at least 2 nodes (the pool's minimum)")
    high = nodes_wanted(
        nodes=5,
        serving=5,
        reading=Reading(queue=("r", 4.0)),
        targets=TARGETS,
        bounds=Bounds(most=8),
    )
    assert (high.wanted, high.reasons[-1]) == (8, "at most 8 nodes (the pool's maximum)")


def test_a_release_on_the_pool_holds_its_nodes_but_lets_it_grow() -> None:
    holds = ["rollout 4 (canary) of rag_pipeline v3 runs"]
    idle, busy = Reading(queue=("r", 0.1)), Reading(queue=("r", 2.0))
    kept = nodes_wanted(nodes=6, serving=5, reading=idle, targets=TARGETS, holds=holds)
    assert (kept.wanted, kept.held) == (6, holds[0])
    assert kept.reasons[-1].startswith("held at its 6 nodes, not 1: rollout 4")
    grown = nodes_wanted(nodes=6, serving=5, reading=busy, targets=TARGETS, holds=holds)
    assert grown.wanted == 10
    assert grown.reasons[-1].startswith("scale-out while rollout 4")


def test_a_pin_replaces_every_reading() -> None:
    pinned = Bounds(pinned=3, pinned_why="GPU quota (ann)")
    signal = nodes_wanted(
        nodes=9, serving=9, reading=Reading(queue=("r", 5.0)), targets=TARGETS, bounds=pinned
    )
    assert (signal.wanted, signal.reasons) == (3, ["pinned at 3 nodes: GPU quota (ann)"])


# An HPA's arithmetic ------------------------------------------------------------------------------


def test_an_external_average_value_metric_asks_for_its_value_outside_the_tolerance() -> None:
    assert hpa.external_average_value(current=10, value=10.5) == 10  # within 10 %
    assert hpa.external_average_value(current=10, value=12) == 12
    assert hpa.external_average_value(current=11, value=10) == 11
    assert hpa.external_average_value(current=11, value=10, tolerance=0) == 10
    assert hpa.external_average_value(current=0, value=3) == 3


def test_an_autoscaler_scales_out_at_once_and_in_after_its_stabilization_window() -> None:
    scaler = hpa.Autoscaler(least=1, most=20, tolerance=0)
    assert scaler.recommend(now=0, current=2, value=3) == 3
    assert scaler.recommend(now=15, current=3, value=20) == 7  # at most +4 a period from 3
    assert scaler.recommend(now=30, current=7, value=2) == 7  # the window asked 20: no scale-in
    assert scaler.recommend(now=314, current=7, value=2) == 7  # 15 s is inside it still
    assert scaler.recommend(now=316, current=7, value=2) == 2  # 20 was asked 301 s ago
    assert hpa.Autoscaler(least=3, most=20).recommend(now=0, current=3, value=1) == 3


# The tick ---------------------------------------------------------------------------------------


@pytest.fixture
def fleet(db: None) -> NodePool:
    """Pool gpu: three nodes in traffic, one drained, one joining; serving rag_pipeline v3,
    whose newest perf_analyzer run measured 10 requests a second a node within its budget."""
    pool = NodePool.objects.create(name="gpu")
    for name, values in [
        ("gpu-1", {}),
        ("gpu-2", {}),
        ("gpu-3", {}),
        ("gpu-4", {"draining": True}),
        ("gpu-5", {"stage": Node.Stage.JOINING}),
        ("gpu-6", {"stage": Node.Stage.DEPARTED}),
    ]:
        Node.objects.create(name=name, pool=pool, http_url="http://127.0.0.1:1", **values)
    pipeline = Model.objects.create(name="rag_pipeline", kind=Model.Kind.ENSEMBLE)
    Model.objects.create(name="reranker")
    Deployment.objects.create(pool=pool, model=pipeline, version=3)
    perf_measured(pipeline, 3, rate=10.0, node="gpu-1")
    NodePool.objects.create(name="cpu")  # no nodes, no series
    return pool


def answer(monkeypatch: pytest.MonkeyPatch, series: Series | Exception) -> None:
    def instant_query(query: str) -> Series:
        assert "sum by (pool, model, version) (rate(nv_inference_request_success[60s]))" in query
        if isinstance(series, Exception):
            raise series
        return series

    monkeypatch.setattr(selectors, "instant_query", instant_query)


def gpu_series(rate: float, reranker: float, pipeline_queue: float = 9.0) -> Series:
    """Pool gpu's series: `rate` requests a second of rag_pipeline, its reranker waiting
    `reranker` times its compute time, the ensemble's own queue `pipeline_queue` times (never a
    step's); another pool's too."""

    def step(pool: str, model: str, version: str, **measures: float) -> Series:
        labels = {"pool": pool, "model": model, "version": version}
        return [(labels | {"measure": name}, value) for name, value in measures.items()]

    return [
        *step("gpu", "rag_pipeline", "1", rate=rate, queue=pipeline_queue * 1000, compute=1000),
        *step("gpu", "reranker", "1", rate=rate, queue=reranker * 1000, compute=1000),
        *step("elsewhere", "rag_pipeline", "1", rate=500.0),
    ]


def test_a_tick_saves_each_pools_signal_and_audits_each_change_with_its_reasons(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer(monkeypatch, gpu_series(rate=40.0, reranker=0.5))
    assert scaling_tick() == 2  # both pools' first counts
    gpu = Scaling.objects.get(pool=fleet)
    # 40/s at 8 a node: 5 (the ensemble's own queue ratio is not a step's; the reranker's
    # 0.5 on 3 nodes in traffic asks 2)
    assert (gpu.wanted, gpu.nodes, gpu.held) == (5, 5, "")
    assert gpu.reasons[0].startswith("load: rag_pipeline v3 40.0/s of 10.0 a node (run")
    cpu = Scaling.objects.get(pool__name="cpu")
    assert (cpu.wanted, cpu.reasons) == (
        0,
        ["no evidence (no request series of the pool in Prometheus): held at its 0 nodes"],
    )
    event = AuditEvent.objects.get(action="pool.scale", target="pool:gpu")
    assert (event.actor, event.before, event.after["wanted"]) == (
        "system:autoscaler",
        {"wanted": None, "nodes": 5},
        5,
    )
    assert event.after["reasons"] == gpu.reasons

    assert scaling_tick() == 0  # the same readings: nothing on the trail
    answer(monkeypatch, PrometheusUnavailable("Prometheus at http://p did not answer."))
    assert scaling_tick() == 0
    gpu.refresh_from_db()
    assert gpu.wanted == 5 and "did not answer" in gpu.reasons[0]


def test_a_running_rollout_holds_the_pool_and_keeps_its_canary_nodes(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=fleet,
        baseline_version=2,
        canary_version=3,
        plan=[{"nodes": 1}, {"percent": 100}],
        state=Rollout.State.PROGRESSING,
        canary_nodes=["gpu-2"],
        started_by="ann",
    )
    answer(monkeypatch, gpu_series(rate=4.0, reranker=0.1))
    scaling_tick()
    gpu = Scaling.objects.get(pool=fleet)
    assert gpu.wanted == 5 and gpu.held.startswith("rollout ")
    assert "no scale-in" in gpu.reasons[-1]
    # Out of traffic first (the joining and the drained node, newest first), never the canary.
    assert list(scale_in_order(fleet).values_list("name", flat=True)) == [
        "gpu-5",
        "gpu-4",
        "gpu-3",
        "gpu-1",
    ]


# What people set -------------------------------------------------------------------------------


def test_a_pin_takes_effect_at_once_needs_a_reason_and_an_operator(fleet: NodePool) -> None:
    operator, viewer = make_user(Role.OPERATOR), make_user(Role.VIEWER)
    with pytest.raises(ScalingError, match="needs a reason"):
        scaling_pin(pool_name="gpu", nodes=2, reason=" ", actor=operator)
    with pytest.raises(PermissionDenied, match=r"needs fleet\.operate_node"):
        scaling_pin(pool_name="gpu", nodes=2, reason="quota", actor=viewer)
    fleet.protected = True
    fleet.save()
    row = scaling_pin(pool_name="gpu", nodes=2, reason="GPU quota", actor=operator)  # never held
    assert (row.wanted, row.reasons) == (2, ["pinned at 2 nodes: GPU quota (operator-user)"])
    event = AuditEvent.objects.get(action="pool.pin_scaling", result="ok")
    assert event.after == {"pinned": 2, "pinned_by": "operator-user", "pinned_reason": "GPU quota"}
    scaling_pin(pool_name="gpu", nodes=None, reason="", actor=operator)
    assert Scaling.objects.get(pool=fleet).pinned is None


@pytest.mark.django_db(transaction=True)
def test_a_pin_during_a_tick_waits_for_its_write_and_stands(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A person pins while a tick computes: the pin waits for the tick's write, then applies,
    rather than a count computed without it replacing the pin's."""
    answer(monkeypatch, gpu_series(rate=40.0, reranker=0.5))
    scaling_tick()
    operator = make_user(Role.OPERATOR)

    def pin() -> None:
        try:
            scaling_pin(pool_name="gpu", nodes=2, reason="GPU quota", actor=operator)
        finally:
            connection.close()

    pinning = threading.Thread(target=pin)
    computed = services.nodes_wanted

    def nodes_wanted(**kwargs: Any) -> Any:
        if pinning.ident is None:  # not started: the tick's first pool
            pinning.start()
            pinning.join(timeout=1.0)  # it waits for the tick, or it has pinned already
        return computed(**kwargs)

    monkeypatch.setattr(services, "nodes_wanted", nodes_wanted)
    answer(monkeypatch, gpu_series(rate=60.0, reranker=0.5))
    scaling_tick()
    pinning.join()
    gpu = Scaling.objects.get(pool=fleet)
    assert (gpu.pinned, gpu.wanted) == (2, 2), gpu.reasons


def test_bounds_wait_for_a_second_person_on_a_protected_pool(fleet: NodePool) -> None:
    manager = make_user(Role.RELEASE_MANAGER)
    with pytest.raises(ScalingError, match="at most 1 nodes is fewer than at least 2"):
        scaling_set(pool_name="gpu", least=2, most=1, actor=manager)
    scaling_set(pool_name="gpu", least=2, most=10, actor=manager)
    assert Scaling.objects.filter(pool=fleet, least=2, most=10).exists()
    fleet.protected = True
    fleet.save()
    with pytest.raises(ApprovalRequired):
        scaling_set(pool_name="gpu", least=3, most=10, actor=manager)
    assert Scaling.objects.get(pool=fleet).least == 2


# What an autoscaler reads ----------------------------------------------------------------------


def test_metrics_export_the_signal_and_an_hpa_on_it_asks_for_what_the_product_wants(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch, client: Client, viewer: User
) -> None:
    answer(monkeypatch, gpu_series(rate=90.0, reranker=0.5))
    scaling_tick()
    samples = scrape(client, scrape_headers(viewer))
    wanted = matching(samples, "controlplane_pool_nodes_wanted")
    assert wanted == {("cpu",): 0, ("gpu",): 12}  # 90 / (10 x 0.8)
    assert matching(samples, "controlplane_pool_nodes_held") == {("cpu",): 0, ("gpu",): 0}
    # The chart's HPA: an External metric, AverageValue 1, tolerance 0 (tests/integration
    # renders the chart and reads these from it).
    assert hpa.external_average_value(current=5, value=wanted["gpu",], tolerance=0) == 12
    scaling_pin(pool_name="gpu", nodes=4, reason="quota", actor=make_user(Role.OPERATOR))
    samples = scrape(client, scrape_headers(viewer))
    assert matching(samples, "controlplane_pool_nodes_wanted")["gpu",] == 4
    assert matching(samples, "controlplane_pool_nodes_held")["gpu",] == 2


# The page --------------------------------------------------------------------------------------


def test_the_page_shows_the_reasons_at_the_same_cost_for_many_nodes(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch, client: Client
) -> None:
    answer(monkeypatch, gpu_series(rate=40.0, reranker=0.5))
    scaling_tick()
    client.force_login(make_user(Role.OPERATOR))

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = client.get("/pools/gpu/scaling/")
        assert response.status_code == 200
        assert (
            b"5 nodes wanted" in response.content and b"40.0/s of 10.0 a node" in response.content
        )
        return len(captured)

    few = queries()
    Node.objects.bulk_create(
        Node(name=f"more-{i}", pool=fleet, http_url="http://127.0.0.1:1") for i in range(50)
    )
    assert queries() == few


def test_pin_and_bounds_forms_answer_bad_input_with_the_field(
    fleet: NodePool, client: Client
) -> None:
    client.force_login(make_user(Role.RELEASE_MANAGER))
    response = client.post("/pools/gpu/scaling/pin/", {"nodes": "two", "reason": "x"}, follow=True)
    assert b"nodes: a whole number, not &#x27;two&#x27;" in response.content
    response = client.post("/pools/gpu/scaling/bounds/", {"least": "3", "most": "2"}, follow=True)
    assert b"at most 2 nodes is fewer than at least 3" in response.content
    response = client.post("/pools/gpu/scaling/pin/", {"nodes": "2", "reason": "quota"})
    assert response.status_code == 302
    assert Scaling.objects.get(pool=fleet).pinned == 2


# The API -------------------------------------------------------------------------------------------


def test_the_api_reads_the_signal_and_the_nodes_a_scale_in_takes_first(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch, client: Client
) -> None:
    answer(monkeypatch, gpu_series(rate=8.0, reranker=0.5))
    scaling_tick()  # 8/s at 8 a node: 1; the reranker's 0.5 on 3 nodes in traffic: 2
    headers = bearer(make_user(Role.OPERATOR))
    body = client.get("/api/pools/gpu/scaling", headers=headers).json()
    assert (body["wanted"], body["nodes"], body["serving"]) == (2, 5, 3)
    assert body["remove_first"] == ["gpu-5", "gpu-4", "gpu-3"]  # out of traffic first
    assert client.get("/api/pools/nowhere/scaling", headers=headers).status_code == 404

    pinned = client.put(
        "/api/pools/gpu/scaling/pin",
        {"nodes": 4, "reason": "drill"},
        content_type="application/json",
        headers=headers,
    )
    assert pinned.status_code == 200
    assert (pinned.json()["wanted"], pinned.json()["remove_first"]) == (4, ["gpu-5"])
    refused = client.put(
        "/api/pools/gpu/scaling/pin", {"nodes": 4}, content_type="application/json", headers=headers
    )
    assert (refused.status_code, refused.json()["error"]["message"]) == (
        409,
        "a pin needs a reason: the page and the trail show it",
    )
    fleet.protected = True
    fleet.save()
    waits = client.put(
        "/api/pools/gpu/scaling/bounds",
        {"least": 2, "most": 6},
        content_type="application/json",
        headers=bearer(make_user(Role.RELEASE_MANAGER)),
    )
    assert waits.status_code == 202 and waits.json()["status"] == "pending"


def test_a_search_holds_its_pool_until_it_ends_or_is_lost(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = PerfSearch.objects.create(
        pipeline=Model.objects.get(name="rag_pipeline"),
        version=3,
        step="reranker",
        pool_name="gpu",
        node=Node.objects.get(name="gpu-1"),
        node_name="gpu-1",
        concurrency=4,
        requests=100,
        status=PerfSearch.Status.RUNNING,
        requested_by="ann",
    )
    answer(monkeypatch, gpu_series(rate=4.0, reranker=0.1))
    scaling_tick()
    assert Scaling.objects.get(pool=fleet).held == f"search {search.pk} holds gpu-1 aside"
    assert "gpu-1" not in scale_in_order(fleet).values_list("name", flat=True)
    # Its worker lost: past the longest a search may take, it holds nothing.
    lost = timezone.now() - search_lost_after() - timedelta(seconds=1)
    PerfSearch.objects.filter(pk=search.pk).update(created_at=lost)
    scaling_tick()
    assert Scaling.objects.get(pool=fleet).held == ""
    assert "gpu-1" in scale_in_order(fleet).values_list("name", flat=True)
