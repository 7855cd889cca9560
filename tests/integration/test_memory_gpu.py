"""The GPU path of memory-aware loads on a real Prometheus, backfilled (promtool) with Triton's
GPU series: a node's room is its emptiest GPU's free memory as Prometheus last read it, fresh
within FLEET_MEMORY_MAX_AGE_S; a load that would not fit is refused with the device's numbers;
the capacity page reads every node's GPUs in one query."""

import time
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.fleet import memory
from apps.fleet.desired import Want
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from tests.support.backfill import backfilled_prometheus, gpu_memory

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

GIB = 1024**3
MAX_AGE_S = 120
# node, GPU: (bytes used of 80 GiB, how long ago Prometheus last read it)
READINGS = {
    ("gpu-1", "GPU-5f3a0c4e-aaaa"): (70 * GIB, 0),
    ("gpu-1", "GPU-5f3a0c4e-bbbb"): (20 * GIB, 0),  # the emptiest: 60 GiB free
    # Stopped reporting 200 s ago: still within an instant query's 5 minutes, not fresh.
    ("gpu-2", "GPU-5f3a0c4e-cccc"): (0, 200),
}


@pytest.fixture(scope="module")
def gpu_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    readings = {
        where: (used, 80 * GIB, range(now - ago - 600, now - ago + 1, 5))
        for where, (used, ago) in READINGS.items()
    }
    with backfilled_prometheus(tmp_path_factory.mktemp("gpu-rooms"), gpu_memory(readings)) as url:
        yield url


@pytest.fixture
def gpus(gpu_prometheus: str, settings: object) -> NodePool:
    """Two GPU nodes (as their polls found them) and an LLM of 20, 60 and 50 GiB declared."""
    settings.PROMETHEUS_URL = gpu_prometheus  # type: ignore[attr-defined]
    settings.FLEET_MEMORY_MAX_AGE_S = MAX_AGE_S  # type: ignore[attr-defined]
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2"):
        inventory = [{"uuid": uuid} for node, uuid in READINGS if node == name]
        Node.objects.create(name=name, pool=pool, http_url="http://10.0.0.9:8000", gpus=inventory)
    model = Model.objects.create(name="llm")
    for version, gib in ((1, 20), (2, 60), (3, 50)):
        ModelVersion.objects.create(
            model=model,
            version=version,
            config={"name": "llm"},
            memory_mb=gib * 1024,
            status=ModelVersion.Status.PUBLISHED,
        )
    return pool


def test_a_gpu_nodes_room_is_its_emptiest_fresh_device(gpus: NodePool) -> None:
    fresh, stale = Node.objects.filter(pool=gpus).order_by("name")
    found = memory.room(fresh, {"llm": {1}})
    assert found.free_mb == 60 * 1024
    assert found.where == "GPU GPU-5f3a0c4e-bbbb of 81920 MiB"
    assert found.taken == [("llm v1", 20 * 1024)]
    # 60 GiB with 10 % headroom is 67584 MiB: more than 61440 free. 50 GiB fits.
    assert memory.refusal(fresh, "llm", {2}, {"llm": {1}}) == (
        "does not fit, not sent: llm v2 61440 MiB (declared) needs 67584 MiB with 10% headroom;"
        " GPU GPU-5f3a0c4e-bbbb of 81920 MiB has 61440 MiB free;"
        " unloading llm v1 (20480 MiB) would free the most"
    )
    assert memory.refusal(fresh, "llm", {3}, {"llm": {1}}) == ""
    gone = memory.room(stale, {})
    assert gone.free_mb is None and "no reading of the last 120 s" in gone.where
    assert memory.refusal(stale, "llm", {2}, {}) == ""  # nothing known: let through, measured


def test_a_deployment_that_will_not_fit_a_gpu_node_is_warned_of_before_and_after(
    gpus: NodePool, client: Client, viewer: User
) -> None:
    # Before: what the deploy form and the rollout preview warn of, from the same readings.
    nodes = list(gpus.nodes.order_by("name"))
    assert memory.shortfalls(gpus, nodes, {"llm": Want(3, None, "llm v3")}) == []
    assert memory.shortfalls(gpus, nodes, {"llm": Want(2, None, "llm v2")}) == [
        "gpu-1 needs 67584 MiB with headroom for llm v2; GPU GPU-5f3a0c4e-bbbb of 81920 MiB"
        " has 61440 MiB free"
    ]
    # After: the pool's memory page.
    deployment_set(model_name="llm", version=2, pool=gpus, actor="ops")
    client.force_login(viewer)
    page = client.get("/pools/gpu/capacity/").content.decode()
    assert "Will not fit:</strong> gpu-1 needs 61440 MiB for llm v2, has 61440 MiB free" in page
    row = page.split('id="capacity-gpu-1"')[1].split("</tr>")[0]
    assert "GPU GPU-5f3a0c4e-bbbb of 81920 MiB" in row and "does not fit" in row
    row = page.split('id="capacity-gpu-2"')[1].split("</tr>")[0]
    assert "no reading of the last 120 s" in row and "unknown" in row
