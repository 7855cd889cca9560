"""The nodes a pool needs, read from a real Prometheus holding rag_pipeline's steps' counters on
two nodes of pool gpu (backfilled by promtool): 80 requests a second, the reranker waiting 40 ms
(2 of them its batching delay) for 10 ms of compute, GPUs 30 % busy."""

import time
from collections.abc import Iterator

import pytest

from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, Node, NodePool
from apps.registry.models import Model
from apps.scaling.models import Scaling
from apps.scaling.services import scaling_tick
from tests.support.backfill import backfilled_prometheus, pipeline_steps
from tests.support.quality import perf_measured
from tests.support.registry import import_demo

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture(scope="module")
def steps_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    # Ten minutes ahead too: the signal reads the last minute, whenever the test runs.
    text = pipeline_steps(range(now - 300, now + 600, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("scaling"), text) as url:
        yield url


def test_the_queueing_reranker_asks_for_more_nodes_than_the_load_does(
    steps_prometheus: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = steps_prometheus  # type: ignore[attr-defined]
    import_demo()
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        Node.objects.create(name=name, pool=pool, http_url="http://127.0.0.1:1")
    Node.objects.filter(name="gpu-3").update(draining=True)  # in the pool, out of traffic
    pipeline = Model.objects.get(name="rag_pipeline")
    Deployment.objects.create(pool=pool, model=pipeline, version=1)
    run = perf_measured(pipeline, 1, rate=25.0, node="gpu-1")

    assert scaling_tick() == 1
    scaling = Scaling.objects.get(pool=pool)
    load, queue, gpu = scaling.reasons
    assert load == (
        f"load: rag_pipeline v1 80.0/s of 25.0 a node (run {run.pk}), at 80% of capacity: 4 nodes"
    )
    # The step that queues is named (an ensemble's own series are no step's): 40 ms waiting a
    # request, 2 of them its batching delay, for 10 ms of compute.
    assert queue == (
        "queue: reranker waits 3.80x its compute time (its batching delay aside) on 2 nodes in"
        " traffic (target 1x): 8 nodes"
    )
    assert gpu == "GPU: 30% busy on 2 nodes in traffic (target 70%): 1 node"
    assert (scaling.wanted, scaling.nodes) == (8, 3)
    assert AuditEvent.objects.get(action="pool.scale").after["wanted"] == 8

    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # type: ignore[attr-defined]
    assert scaling_tick() == 0
    scaling.refresh_from_db()
    assert scaling.wanted == 8  # a scale-out under way goes on
    assert scaling.reasons == [
        "no evidence (Prometheus at http://127.0.0.1:9 did not answer: connection failed.):"
        " keeps the 8 nodes it last asked for"
    ]
