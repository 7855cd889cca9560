"""Memory charts: GPU memory per GPU from a Prometheus backfilled (promtool) with Triton's exact GPU
series, and CPU memory from the real CPU nodes."""

import json
import re
import time
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.fleet.models import Node, NodePool
from tests.support.backfill import backfilled_prometheus, gpu_memory
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

GIB = 1024**3
GPUS = {"GPU-5f3a0c4e-1111": 30 * GIB, "GPU-5f3a0c4e-2222": 12 * GIB}


@pytest.fixture(scope="module")
def gpu_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus whose TSDB holds 30 minutes of Triton GPU metrics written by promtool."""
    times = range(int(time.time()) - 1800, int(time.time()) - 60, 30)
    readings = {("gpu-1", uuid): (used, 80 * GIB, times) for uuid, used in GPUS.items()}
    with backfilled_prometheus(
        tmp_path_factory.mktemp("gpu-prometheus"), gpu_memory(readings)
    ) as url:
        yield url


def figure(body: str) -> dict:
    match = re.search(
        r'<script type="application/json" id="metrics-figure">(.*?)</script>', body, re.S
    )
    assert match, body
    return json.loads(match.group(1))


def test_gpu_memory_is_charted_per_gpu(
    gpu_prometheus: str, client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = gpu_prometheus  # type: ignore[attr-defined]
    node = Node.objects.create(
        name="gpu-1",
        pool=NodePool.objects.create(name="gpu"),
        http_url="http://10.0.0.9:8000",
        gpus=[
            {"uuid": uuid, "total": 80.0 * GIB, "used": float(used)} for uuid, used in GPUS.items()
        ],
    )
    client.force_login(viewer)
    page = client.get(f"/nodes/{node.name}/").content.decode()
    assert "GPU memory, per GPU" in page and "metric=gpu_memory&amp;node=gpu-1" in page
    body = client.get(
        "/metrics/?metric=gpu_memory&node=gpu-1&range=1h", headers={"HX-Request": "true"}
    ).content.decode()
    traces = {trace["name"]: trace for trace in figure(body)["data"]}
    assert set(traces) == {f"gpu-1 {uuid}" for uuid in GPUS}
    for uuid, used in GPUS.items():
        values = [v for v in traces[f"gpu-1 {uuid}"]["y"] if v is not None]
        assert values and all(abs(v - used / GIB) < 1e-6 for v in values)
    assert figure(body)["layout"]["yaxis"]["title"]["text"] == "GiB"


def test_a_cpu_node_shows_its_cpu_memory(
    fleet: Fleet, client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    proc = fleet.state.nodes[0]
    node = Node.objects.create(
        name=proc.name, pool=NodePool.objects.create(name="it"), **fleet.state.node_urls(proc)
    )
    client.force_login(viewer)
    assert "metric=cpu_memory" in client.get(f"/nodes/{node.name}/").content.decode()
    deadline = time.monotonic() + 30
    while True:
        body = client.get(
            f"/metrics/?metric=cpu_memory&node={proc.name}&range=15m",
            headers={"HX-Request": "true"},
        ).content.decode()
        if "metrics-figure" in body or time.monotonic() > deadline:
            break
        time.sleep(1)
    (trace,) = figure(body)["data"]
    assert trace["name"] == proc.name
    assert all(0 < v < 1024 for v in trace["y"] if v is not None)  # GiB
