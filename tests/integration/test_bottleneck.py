"""Where rag_pipeline's time goes, read from a real Prometheus holding its steps' counters on two
nodes of pool gpu (backfilled by promtool): the reranker, one instance that queues, is named
first with its queue and compute times, and its advice is more instances."""

import json
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.fleet.models import Deployment, NodePool
from apps.observability.charts import metric_chart
from apps.registry.models import Model, ModelVersion
from tests.support.backfill import backfilled_prometheus, pipeline_steps
from tests.support.registry import import_demo

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture(scope="module")
def steps_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    text = pipeline_steps(range(now - 900, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("bottleneck"), text) as url:
        yield url


def test_the_step_that_queues_is_named_first_with_its_evidence_and_advice(
    steps_prometheus: str, settings: object, client: Client, viewer: User
) -> None:
    settings.PROMETHEUS_URL = steps_prometheus  # type: ignore[attr-defined]
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    Deployment.objects.create(pool=pool, model=Model.objects.get(name="rag_pipeline"), version=1)
    client.force_login(viewer)
    body = client.get("/metrics/bottleneck/rag_pipeline/?pool=gpu").content.decode()
    assert "Slowest step: reranker v1" in body
    # 80 requests/s over two nodes, 40 ms waiting for 10 ms computing: one instance a node, busy
    # 40 % of the time; 3 pending on each.
    assert "requests wait 40.0 ms for 10.0 ms of compute, 6.0 pending on average over its 2" in body
    assert "1 instance(s) a node compute 40% of the time at 80.0 requests/s, GPUs 30% busy" in body
    assert "Advice: more instances: 1 -&gt; 2" in body
    assert "rag_pipeline v" not in body.split('id="steps"')[1]  # its own timings are no step


def test_cost_per_request_and_gpu_utilization_are_charted(
    steps_prometheus: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = steps_prometheus  # type: ignore[attr-defined]
    end = timezone.now()

    def chart(metric: str, model: str = "") -> dict[str, list[float]]:
        drawn = metric_chart(metric, start=end - timedelta(minutes=10), end=end, model=model)
        traces = json.loads(drawn.figure_json)["data"]
        return {t["name"]: [y for y in t["y"] if y is not None] for t in traces if "y" in t}

    # The reranker computes 10 ms a request, one request an execution: 10 GPU-seconds per 1,000.
    (reranker,) = chart("cost", "reranker").values()
    assert reranker and all(abs(y - 10.0) < 0.01 for y in reranker)
    by_node = chart("gpu_util")
    assert len(by_node) == 2 and all(abs(y - 30.0) < 0.01 for ys in by_node.values() for y in ys)
