"""Where an ensemble's time goes: its steps' counters read in one Prometheus query (stubbed
here, at that boundary; tests/integration/test_bottleneck.py reads a real one), the slowest step
named with its evidence, and advice with the numbers behind it."""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.fleet.models import Deployment, NodePool
from apps.observability import bottleneck
from apps.prometheus.catalog import bottleneck_query
from apps.registry.models import Model, ModelVersion
from tests.support.registry import import_demo

STEPS = ["embedder", "retriever", "reranker", "generator"]
WINDOW = bottleneck.WINDOW_S


def counters(
    rate: float = 10.0,
    queue_ms: float = 1.0,
    infer_ms: float = 5.0,
    batch: float = 1.0,
    pending: float = 0.0,
) -> dict[str, float]:
    """A step's measures over the window, as the query answers them."""
    requests = rate * WINDOW
    return {
        "requests": requests,
        "queue_us": requests * queue_ms * 1000,
        "input_us": requests * 100,
        "infer_us": requests * infer_ms * 1000,
        "output_us": requests * 100,
        "inferences": requests,
        "executions": requests / batch,
        "pending": pending,
        "nodes": 1,
    }


@pytest.fixture
def pipeline(db: None) -> NodePool:
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    Deployment.objects.create(pool=pool, model=Model.objects.get(name="rag_pipeline"), version=1)
    return pool


def answering(
    monkeypatch: pytest.MonkeyPatch, steps: dict[str, dict[str, float]], gpu_util: float | None
) -> list[str]:
    """Prometheus answers `steps`' measures (and the pool's GPUs' utilization, if any); returns
    the queries asked."""
    asked: list[str] = []

    def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
        asked.append(query)
        rows = [
            ({"model": model, "measure": measure}, value)
            for model, measures in steps.items()
            for measure, value in measures.items()
        ]
        if gpu_util is not None:
            rows += [({"measure": "gpu_util"}, gpu_util), ({"measure": "gpu_util_peak"}, 1.0)]
        return rows

    monkeypatch.setattr(bottleneck, "instant_query", instant_query)
    return asked


def page(client: Client, user: User, pool: str = "gpu") -> str:
    client.force_login(user)
    response = client.get(f"/metrics/bottleneck/rag_pipeline/?pool={pool}")
    assert response.status_code == 200
    return response.content.decode()


def test_a_step_that_queues_with_idle_gpus_is_named_and_gets_more_instances(
    pipeline: NodePool, client: Client, viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reranker: 40 ms waiting for 10 ms of compute, 3 requests pending; its one instance
    # computes 40 executions/s x 10 ms = 40 % of the time, so one more is enough.
    steps = {name: counters() for name in STEPS}
    steps["reranker"] = counters(rate=40, queue_ms=40, infer_ms=9.8, pending=3)
    asked = answering(monkeypatch, steps, gpu_util=0.3)
    body = page(client, viewer)
    assert len(asked) == 1
    assert "Slowest step: reranker v1" in body
    assert "Advice: more instances: 1 -&gt; 2" in body
    assert "requests wait 40.0 ms for 10.0 ms of compute, 3.0 pending on average over its 1" in body
    assert "GPUs 30% busy" in body


def test_how_many_instances_comes_from_the_measured_rates(pipeline: NodePool) -> None:
    # 90 executions/s x 20 ms = 1.8 instances' worth of compute; at 70 % busy each, 3. Its
    # batches are small, but it already waits 2 ms to gather them: no batching advice.
    step = bottleneck._step(
        "reranker",
        1,
        bottleneck.StepConfig(1, default_instances=False, max_batch_size=8, batching_delay_us=2000),
        {
            ("reranker", m): v
            for m, v in counters(rate=90, queue_ms=80, infer_ms=19.8, pending=5).items()
        },
    )
    (advice,) = bottleneck.advise(step, bottleneck.Gpus(0.5, 0.6, None, None))
    assert advice.change == "more instances: 1 -> 3"
    assert advice.fields == {"instance_group": [{"count": 3}]}
    assert "about 60% of the time" in advice.expect


def test_a_saturated_gpu_asks_for_nodes_not_instances(
    pipeline: NodePool, client: Client, viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = {name: counters() for name in STEPS}
    steps["generator"] = counters(rate=40, queue_ms=40, infer_ms=9.8, pending=3)
    answering(monkeypatch, steps, gpu_util=0.95)
    body = page(client, viewer)
    assert "Slowest step: generator v1" in body
    assert "Advice: more nodes, not instances" in body
    assert "more instances" not in body


def test_small_batches_at_a_high_rate_get_a_batching_delay(pipeline: NodePool) -> None:
    config = bottleneck.StepConfig(
        2, default_instances=False, max_batch_size=8, batching_delay_us=None
    )
    measures = counters(rate=100, queue_ms=1, infer_ms=3.8, batch=1.2)
    step = bottleneck._step(
        "embedder", 1, config, {("embedder", m): v for m, v in measures.items()}
    )
    (advice,) = bottleneck.advise(step, bottleneck.Gpus(None, None, None, None))
    assert advice.change == "a dynamic-batching delay of 1000 us"
    assert (
        "batches average 1.2 of up to 8 at 83 executions/s, with no dynamic batching"
        in advice.because
    )
    assert advice.fields == {"dynamic_batching": {"max_queue_delay_microseconds": "1000"}}


def test_too_few_requests_name_no_step_and_say_so(
    pipeline: NodePool, client: Client, viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = {name: counters() for name in STEPS}
    steps["retriever"] = counters(rate=0.1, queue_ms=500, pending=4)  # 30 requests
    answering(monkeypatch, steps, gpu_util=None)
    body = page(client, viewer)
    assert "No step named: too few requests to judge" in body
    assert "retriever served 30 requests in 5 min" in body
    assert "Slowest step" not in body and "Advice" not in body
    assert "none reported (a CPU pool)" in body


def test_one_query_whatever_the_number_of_steps() -> None:
    few = bottleneck_query(steps=["a", "b"], pool="gpu", window_s=300)
    many = bottleneck_query(steps=[f"m{i}" for i in range(40)], pool="gpu", window_s=300)
    assert few.count("label_replace") == many.count("label_replace") == 13
    assert 'model=~"a|b"' in few and 'pool="gpu"' in few


def test_the_page_renders_with_prometheus_away_and_says_why(
    pipeline: NodePool, client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    body = page(client, viewer)
    assert (
        "Where the time goes is read from Prometheus: Prometheus at http://127.0.0.1:1 did not answer"
        in body
    )


def test_only_an_ensemble_has_a_pipeline_and_an_unknown_pool_is_said(
    pipeline: NodePool, client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    assert client.get("/metrics/bottleneck/embedder/").status_code == 404
    response = client.get("/metrics/bottleneck/rag_pipeline/?pool=nope")
    assert response.status_code == 404
    assert "No pool named &#x27;nope&#x27;." in response.content.decode()
