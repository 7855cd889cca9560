"""What a pool's users feel is what its nodes in traffic serve: read from a real Prometheus
(backfilled by promtool) holding rag_pipeline's series on pool gpu, where two serving nodes
answer in 500 ms and a quarantined node and a stray target labelled with the pool take 9 s, the
degradation automation keeps the pool on its primary; the slow node back in traffic steps it
down."""

import time
from collections.abc import Iterator

import pytest

from apps.degradation import automation
from apps.degradation.models import Tiers
from apps.degradation.services import tiers_set
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import ModelVersion
from apps.registry.services import model_set_budget
from tests.support.backfill import backfilled_prometheus
from tests.support.registry import import_demo

pytestmark = [pytest.mark.integration, pytest.mark.django_db]
P99_US = {"gpu-1": 500_000, "gpu-2": 500_000, "gpu-3": 9_000_000, "gpu-stray": 9_000_000}


def series(times: range) -> str:
    """Per node: 40 rag_pipeline requests a second, all answered, at the P99 of P99_US."""
    success, summary = "nv_inference_request_success", "nv_inference_request_summary_us"
    lines = [f"# HELP {success} backfilled", f"# TYPE {success} gauge"]
    for node in P99_US:
        labels = f'model="rag_pipeline",node="{node}",pool="gpu",version="1"'
        lines += [f"{success}{{{labels}}} {40 * (t - times[0])} {t}" for t in times]
    lines += [f"# HELP {summary} backfilled", f"# TYPE {summary} gauge"]
    for node, p99 in P99_US.items():
        labels = f'model="rag_pipeline",node="{node}",pool="gpu",quantile="0.99",version="1"'
        lines += [f"{summary}{{{labels}}} {p99} {t}" for t in times]
    return "\n".join(lines) + "\n# EOF\n"


@pytest.fixture(scope="module")
def pool_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    with backfilled_prometheus(
        tmp_path_factory.mktemp("degradation"), series(range(now - 900, now + 1, 5))
    ) as url:
        yield url


def test_a_quarantined_or_stray_node_never_steps_its_pool_down(
    pool_prometheus: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = pool_prometheus  # type: ignore[attr-defined]
    settings.DEGRADATION_SHORT_S, settings.DEGRADATION_LONG_S = 30, 120  # type: ignore[attr-defined]
    settings.DEGRADATION_MIN_REQUESTS = 20  # type: ignore[attr-defined]
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        Node.objects.create(name=name, pool=pool, http_url="http://127.0.0.1:1")
    Node.objects.filter(name="gpu-3").update(stage=Node.Stage.QUARANTINED)
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=3000, actor="sre")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    tiers_set(pool_name="gpu", model_name="rag_pipeline", versions=[1, 4, 5], actor="rm")

    tiers = Tiers.objects.get()
    said = automation.tiers_tick(tiers_id=tiers.pk)
    assert "within budget: P99 500 ms over 30 s" in said
    assert pool.deployments.get().version == 1
    Node.objects.filter(name="gpu-3").update(stage=Node.Stage.SERVING)  # cleared, slow still
    said = automation.tiers_tick(tiers_id=tiers.pk)
    assert "P99 9000 ms over 30 s" in said
    assert pool.deployments.get().version == 4
