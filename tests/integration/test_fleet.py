import time
from datetime import timedelta

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.devtools.processes import DevfleetError
from apps.devtools.traffic import send_traffic
from apps.fleet.triton import TritonClient, TritonRejected
from apps.prometheus.client import range_query
from tests.support import REPOSITORY
from tests.support.fleet import Fleet

pytestmark = pytest.mark.integration

QUESTION = np.array([[b"When do I get my refund?"]], dtype=np.object_)


def test_release_loads_its_pinned_steps_and_reads_them_back_ready(
    clients: list[TritonClient],
) -> None:
    for client in clients:
        ready = {(e.model, e.version) for e in client.repository_index() if e.state == "READY"}
        assert ready == {
            ("rag_pipeline", 1),
            ("embedder", 1),
            ("retriever", 1),
            ("reranker", 1),
            ("generator", 1),
        }


def test_a_question_through_the_pipeline_gets_an_answer_and_its_source(
    clients: list[TritonClient],
) -> None:
    for client in clients:
        outputs = client.infer("rag_pipeline", {"QUESTION": QUESTION})
        assert outputs["SOURCE"][0][0] == b"faq:refund-time"
        assert b"Refunds are issued within 5 business days" in outputs["ANSWER"][0][0]


def test_prometheus_holds_the_pipeline_p99_after_real_traffic(
    fleet: Fleet, clients: list[TritonClient], settings: object
) -> None:
    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    query = 'nv_inference_request_summary_us{quantile="0.99",model="rag_pipeline"}'
    deadline = time.monotonic() + 45
    while True:
        send_traffic(clients, model="rag_pipeline", rps=20, seconds=1)
        end = timezone.now()
        series = range_query(query, start=end - timedelta(seconds=30), end=end, step_s=1)
        values = [v for s in series for v in s.values if v is not None]
        if values or time.monotonic() > deadline:
            break
    assert values, f"no P99 for rag_pipeline in Prometheus: {series}"
    assert {s.labels["node"] for s in series} == {p.name for p in fleet.state.nodes}
    assert all(0 < v < 5_000_000 for v in values)  # microseconds


def test_traffic_goes_round_robin_to_every_node(clients: list[TritonClient]) -> None:
    results = send_traffic(clients, model="rag_pipeline", rps=20, seconds=1)
    assert results == {f"{c.node} ok": 10 for c in clients}


def test_metrics_page_draws_p99_from_real_prometheus(
    fleet: Fleet, clients: list[TritonClient], client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    send_traffic(clients, model="rag_pipeline", rps=20, seconds=2)
    client.force_login(viewer)
    body = client.get(
        "/metrics/?metric=p99&model=rag_pipeline&range=15m", headers={"HX-Request": "true"}
    ).content.decode()
    assert 'data-figure-id="metrics-figure"' in body, body
    assert "rag_pipeline v1" in body


def test_triton_rejection_keeps_tritons_own_words(clients: list[TritonClient]) -> None:
    with pytest.raises(TritonRejected, match="no_such_model"):
        clients[0].load("no_such_model")


def test_a_second_fleet_in_the_same_home_is_refused(fleet: Fleet) -> None:
    with pytest.raises(DevfleetError, match="already running"):
        fleet.devfleet.up(nodes=1, pool="it", base_port=None, prometheus_port=None)


@pytest.mark.django_db
def test_import_from_a_live_node_registers_what_it_runs(
    fleet: Fleet, clients: list[TritonClient]
) -> None:
    from apps.fleet.imports import node_import
    from apps.fleet.services.nodes import node_register
    from apps.registry.models import ModelVersion

    proc = fleet.state.nodes[0]
    node = node_register(
        name=proc.name, pool="it", actor="system:test", **fleet.state.node_urls(proc)
    )
    results = node_import(node=node, actor="system:test")
    assert {r.model: (r.ok, r.versions) for r in results} == {
        name: (True, [1])
        for name in ["embedder", "generator", "rag_pipeline", "reranker", "retriever"]
    }
    imported = ModelVersion.objects.get(model__name="rag_pipeline", version=1)
    assert imported.artifact == f"{proc.name}:rag_pipeline/1"
    assert imported.config["ensemble_scheduling"]["step"][0]["model_name"] == "embedder"


@pytest.mark.django_db
def test_step_breakdown_compares_each_step_p99_with_its_budget(
    fleet: Fleet, clients: list[TritonClient], client: Client, viewer: User, settings: object
) -> None:
    from django.core.management import call_command

    from apps.registry.imports import repository_import

    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    # A budget no real pipeline meets, and one every step meets.
    call_command("set_budgets", "rag_pipeline=1", "embedder=60000", "retriever=60000")
    send_traffic(clients, model="rag_pipeline", rps=20, seconds=3)
    client.force_login(viewer)
    deadline = time.monotonic() + 30
    while True:
        body = client.get("/metrics/breakdown/rag_pipeline/").content.decode()
        if body.count(" ms</td>") >= 5 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "Step of v1" in body  # the version actually serving, found from the metrics
    for step in ["embedder v1", "retriever v1", "reranker v1", "generator v1"]:
        assert f"<td>{step}</td>" in body
    rows = body.split("<tr")
    end_to_end = next(row for row in rows if "end to end" in row)
    assert "breach" in end_to_end and "over budget" in end_to_end
    embedder = next(row for row in rows if "embedder v1" in row)
    assert "within" in embedder
