"""Chart markers: one per change, its node operations told on hover; labels above the plot."""

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.audit.models import AuditEvent, target_parts
from apps.fleet.models import Node, NodePool
from apps.observability.charts import figure
from apps.observability.markers import MAX_MARKERS, Marker, change_markers
from apps.prometheus.client import Series

pytestmark = pytest.mark.django_db
STEPS = ["embedder", "retriever", "rag_pipeline"]


def event(action: str, target: str, *, request_id: str = "", **fields: object) -> AuditEvent:
    actor = "system:reconciler" if action.startswith("operation.") else "ops"
    return AuditEvent.objects.create(
        actor=actor, action=action, target=target, request_id=request_id, **fields
    )


def deploy(pool: str, nodes: list[str], request_id: str, version: int = 2) -> None:
    """A deployment to a pool, and the loads on its nodes that carried it out, as the worker
    records them: under the deployment's request id."""
    event(
        "deployment.set",
        f"pool:{pool}:rag_pipeline",
        request_id=request_id,
        after={"version": version},
    )
    for node in nodes:
        for model in STEPS:
            event(
                "operation.load",
                f"node:{node}:{model}",
                request_id=request_id,
                after={"versions": [version]},
            )


def window() -> dict[str, datetime]:
    now = timezone.now()
    return {"start": now - timedelta(minutes=15), "end": now + timedelta(seconds=1)}


def test_a_deployment_and_its_node_operations_are_one_marker_told_on_hover() -> None:
    deploy("demo", ["demo-1", "demo-2", "demo-3"], request_id="req-deploy")
    (marker,) = change_markers(**window(), model="rag_pipeline")
    assert marker.label == "deploy rag_pipeline v2"
    assert marker.text.splitlines() == [
        "deploy rag_pipeline v2 on pool demo by ops — 9 node operations on 3 nodes:",
        "demo-1: load embedder, load retriever, load rag_pipeline",
        "demo-2: load embedder, load retriever, load rag_pipeline",
        "demo-3: load embedder, load retriever, load rag_pipeline",
    ]


def test_operations_without_a_change_and_node_health_stay_markers_of_their_own() -> None:
    deploy("demo", ["demo-1"], request_id="req-deploy")
    event("operation.reload", "node:demo-1:embedder", request_id="req-alice")  # a person's
    event("node.down", "node:demo-2", result="failed", message="connection refused")
    event("node.down", "node:demo-3", result="failed")
    assert [(m.label, m.kind) for m in change_markers(**window())] == [
        ("deploy rag_pipeline v2", "change"),
        ("reload embedder", "operation"),
        ("down demo-2", "down"),
        ("down demo-3", "down"),
    ]


def test_synthetic_requests_a_rollout_made_are_a_marker_of_their_own_kind() -> None:
    from apps.quality.services import synthetic_load_start
    from tests.support.quality import demo_faq

    found = demo_faq()
    pool = NodePool.objects.create(name="trio")
    node = Node.objects.create(name="trio-1", pool=pool, http_url="http://trio-1:8000")
    synthetic_load_start(
        set_id=found.pk,
        nodes=[node],
        rps=2,
        seconds=60,
        actor="system:rollouts",
        purpose="rollout #3, step 1: too few requests to judge",
    )
    NodePool.objects.create(name="other")
    (marker,) = change_markers(**window(), model="rag_pipeline", pool="trio")
    assert (marker.kind, marker.label) == ("synthetic", "synthetic 2 req/s to trio-1")
    assert marker.text == (
        "synthetic 2 req/s to trio-1 on pool trio by system:rollouts: rollout #3, step 1: too"
        " few requests to judge"
    )
    assert change_markers(**window(), model="rag_pipeline", pool="other") == []
    drawn = chart([marker], **window())
    assert drawn["layout"]["shapes"][0]["line"]["color"] == "#6d28d9"


def test_perf_analyzers_runs_and_a_search_are_synthetic_markers_naming_their_node() -> None:
    event("perf.start", "model:rag_pipeline", after={"version": 16, "node": "trio-1"})
    event("perf.search", "pool:trio", after={"step": "reranker", "node": "trio-3"})
    assert [(m.kind, m.label) for m in change_markers(**window())] == [
        ("synthetic", "perf_analyzer v16 on trio-1"),
        ("synthetic", "search of reranker on trio-3"),
    ]


def test_a_rollout_tick_without_a_request_id_is_one_marker_with_its_canary_loads() -> None:
    event("deployment.set", "node:demo-1:rag_pipeline", after={"version": 3, "baseline": 2})
    event("rollout.step", "rollout:7:rag_pipeline", after={"step": 0, "version": 3})
    event("operation.load", "node:demo-1:reranker", after={"versions": [3]})
    event("operation.load", "node:demo-1:rag_pipeline", after={"versions": [2, 3]})
    (marker,) = change_markers(**window())
    assert marker.label == "step rag_pipeline v3"
    assert marker.text.splitlines() == [
        "step rag_pipeline v3 in rollout #7 by ops",
        "also deploy rag_pipeline v3 on demo-1 by ops",
        "2 node operations:",
        "demo-1: load reranker, load rag_pipeline",
    ]


def test_a_pool_chart_has_the_pools_changes_and_its_nodes_health_only() -> None:
    demo, other = NodePool.objects.create(name="demo"), NodePool.objects.create(name="other")
    for name, pool in [("demo-1", demo), ("demo-2", demo), ("demo-10", other)]:
        Node.objects.create(name=name, pool=pool, http_url="http://10.0.0.1:8000")
    deploy("demo", ["demo-1", "demo-2"], request_id="req-demo")
    deploy("other", ["demo-10"], request_id="req-other", version=3)
    event("node.down", "node:demo-2", result="failed")
    event("node.down", "node:demo-10", result="failed")  # a prefix of no node of demo's
    for rollout, canary, pool in [(7, "demo-1", "demo"), (8, "demo-10", "other")]:
        tick = f"req-tick-{rollout}"  # a tick: its canary, its step
        event(
            "deployment.set", f"node:{canary}:rag_pipeline", request_id=tick, after={"version": 3}
        )
        step = {"version": 3, "pool": pool}  # a rollout's target names no pool: its event does
        event("rollout.step", f"rollout:{rollout}:rag_pipeline", request_id=tick, after=step)
    found = change_markers(**window(), pool="demo")
    assert [m.text.splitlines()[0] for m in found] == [
        "deploy rag_pipeline v2 on pool demo by ops — 6 node operations on 2 nodes:",
        "down demo-2 by ops",
        "step rag_pipeline v3 in rollout #7 by ops",
    ]
    assert found[-1].text.splitlines()[1] == "also deploy rag_pipeline v3 on demo-1 by ops"
    assert "demo-10" not in found[0].text


def test_a_node_chart_tells_the_pool_change_its_operations_carried_out() -> None:
    deploy("demo", ["demo-1", "demo-2"], request_id="req-demo")
    (marker,) = change_markers(**window(), node="demo-1")
    assert marker.text.splitlines() == [
        "deploy rag_pipeline v2 on pool demo by ops — 3 node operations:",
        "demo-1: load embedder, load retriever, load rag_pipeline",
    ]


def test_markers_cost_the_same_queries_however_many_events() -> None:
    demo = NodePool.objects.create(name="demo")
    Node.objects.create(name="demo-1", pool=demo, http_url="http://10.0.0.1:8000")

    def queries() -> int:
        with CaptureQueriesContext(connection) as done:
            for where in [{}, {"model": "rag_pipeline"}, {"pool": "demo"}, {"node": "demo-1"}]:
                change_markers(**window(), **where)
        return len(done)

    for n in range(2):  # a change and its 3 operations, twice
        deploy("demo", ["demo-1"], request_id=f"req-{n}", version=n + 1)
    event("node.down", "node:demo-1", result="failed")
    event("operation.reload", "node:demo-1:embedder", request_id="req-alice")
    assert AuditEvent.objects.count() == 10
    few = queries()
    for n in range(2, 24):
        deploy("demo", ["demo-1"], request_id=f"req-{n}", version=n + 1)
    event("node.up", "node:demo-1")
    event("node.down", "node:demo-1", result="failed")
    assert AuditEvent.objects.count() == 100
    assert queries() == few == 4


def test_a_deployment_to_500_nodes_counts_its_operations_and_lists_the_first() -> None:
    event("deployment.set", "pool:big:rag_pipeline", request_id="req-big", after={"version": 2})
    AuditEvent.objects.bulk_create(
        AuditEvent(
            actor="system:reconciler",
            action="operation.load",
            target=f"node:big-{n}:{model}",
            **target_parts(f"node:big-{n}:{model}"),
            request_id="req-big",
            result="failed" if n == 7 and model == "embedder" else "ok",
        )
        for n in range(500)
        for model in STEPS
    )
    with CaptureQueriesContext(connection) as done:
        (marker,) = change_markers(**window(), model="rag_pipeline")
    assert len(done) == 2  # past FEW events, the database counts them
    lines = marker.text.splitlines()
    assert lines[0] == "deploy rag_pipeline v2 on pool big by ops — 1500 node operations, 1 failed:"
    assert lines[1] == "big-0: load embedder, load retriever, load rag_pipeline"
    assert len(lines) == 1 + 6 + 1 and lines[-1] == "… and 1482 more"


def test_operations_of_a_change_before_the_window_are_one_marker() -> None:
    for node in ["demo-1", "demo-2"]:
        for model in STEPS:
            event("operation.load", f"node:{node}:{model}", request_id="req-yesterday")
    (marker,) = change_markers(**window())
    assert (marker.label, marker.kind) == ("6 node operations", "operation")
    assert marker.text.splitlines()[0] == "6 node operations on 2 nodes by system:reconciler:"


def test_markers_stay_within_their_bound() -> None:
    for n in range(MAX_MARKERS + 5):
        event("node.down", f"node:demo-{n}", result="failed")
    found = change_markers(**window())
    assert len(found) == MAX_MARKERS
    assert found[-1].label == f"down demo-{MAX_MARKERS + 4}"  # the newest kept


def chart(markers: list[Marker], start: datetime, end: datetime) -> dict[str, Any]:
    times = [start.timestamp() + 15 * i for i in range(60)]
    series = [Series({"model": "rag_pipeline"}, times, [10.0 + i % 7 for i in range(60)])]
    return figure(series, unit="ms", markers=markers, start=start, end=end)


def test_labels_sit_above_the_plot_upright_and_lines_stay_light() -> None:
    end = timezone.now()
    start = end - timedelta(minutes=15)
    markers = [
        Marker(start + timedelta(minutes=2), "deploy … on pool demo", "deploy rag_pipeline v2"),
        Marker(start + timedelta(minutes=9), "down demo-2 by system:poller", "down demo-2", "down"),
    ]
    layout = chart(markers, start, end)["layout"]
    for label in layout["annotations"]:
        assert (label["yref"], label["yanchor"], label["textangle"]) == ("paper", "bottom", 0)
        assert label["y"] >= 1 and label["yshift"] > 0 and label["font"]["size"] <= 10
    assert [a["text"] for a in layout["annotations"]] == ["deploy rag_pipeline v2", "down demo-2"]
    for line in layout["shapes"]:
        assert line["line"]["width"] <= 1 and line["opacity"] <= 0.5 and line["layer"] == "below"
    assert layout["margin"]["t"] >= 20 + 14  # room for the row of labels


def test_every_marker_has_its_story_on_hover_though_crowded_labels_are_joined() -> None:
    end = timezone.now()
    start = end - timedelta(minutes=15)
    markers = [
        Marker(
            at=start + timedelta(seconds=300 + i),
            text=f"down demo-{i}\nwhy",
            label=f"down demo-{i}",
        )
        for i in range(8)
    ]
    fig = chart(markers, start, end)
    texts = [a["text"] for a in fig["layout"]["annotations"]]
    assert len(texts) == 3  # one per row, the rest joined to the last
    assert texts[-1] == "down demo-2 +5"
    assert "down demo-7<br>why" in fig["layout"]["annotations"][-1]["hovertext"]
    (hover,) = [trace for trace in fig["data"] if trace["name"] == "changes"]
    assert hover["marker"]["opacity"] == 0 and hover["showlegend"] is False
    assert {text.split("<br>")[0] for text in hover["text"]} == {f"down demo-{i}" for i in range(8)}
    assert len(fig["layout"]["shapes"]) == 8


def test_a_chart_without_markers_has_no_hover_trace_nor_label_room() -> None:
    end = timezone.now()
    fig = chart([], end - timedelta(minutes=15), end)
    assert len(fig["data"]) == 1 and fig["layout"]["annotations"] == []
    assert fig["layout"]["margin"]["t"] == 20


def test_two_rollout_transitions_are_two_markers_however_close() -> None:
    event("rollout.aborting", "rollout:7:rag_pipeline", after={"version": 3})
    event("deployment.remove", "node:demo-1:rag_pipeline")
    event("rollout.rolled_back", "rollout:7:rag_pipeline", after={"version": 3})
    assert [m.label for m in change_markers(**window())] == [
        "aborting rag_pipeline v3",
        "rolled_back rag_pipeline v3",
    ]


def test_a_persons_rollback_is_told_before_the_rollout_it_aborted() -> None:
    event("rollout.aborting", "rollout:7:rag_pipeline", request_id="req-1", after={"version": 3})
    event("release.rollback", "pool:demo:rag_pipeline", request_id="req-1", after={"version": 1})
    (marker,) = change_markers(**window())
    assert marker.label == "rollback rag_pipeline v1"
    assert marker.text.splitlines() == [
        "rollback rag_pipeline v1 on pool demo by ops",
        "also aborting rag_pipeline v3 in rollout #7 by ops",
    ]
