"""perf_analyzer against a real Triton node: a version measured at each concurrency of a range,
its figures as perf_analyzer reports them, and Triton's own request counter for that version
reading back exactly the requests it was told to send (nothing more: a gate's requests are all
it sends). A binary that is missing, a node that does not answer, a run out of time: a
PerfError that says which node and model, and why."""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.perf import PerfError, perf_measure
from apps.fleet.triton import TritonClient
from tests.support.fleet import served

pytestmark = pytest.mark.integration
REQUESTS = 300  # at each concurrency


@pytest.fixture(scope="module")
def node(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Devfleet, FleetState]]:
    """One node of the demo repository, serving embedder v1."""
    devfleet = Devfleet(home=tmp_path_factory.mktemp("perf"), repository=repository)
    state = devfleet.up(nodes=1, pool="perf", base_port=None, prometheus_port=None)
    try:
        urls = state.node_urls(state.nodes[0])
        devfleet.load_release(TritonClient(urls["http_url"], node="perf-1"), "embedder", 1)
        yield devfleet, state
    finally:
        devfleet.down()


def test_perf_analyzer_measures_a_version_and_triton_counts_exactly_its_requests(
    node: tuple[Devfleet, FleetState],
) -> None:
    _, state = node
    grpc_url = state.node_urls(state.nodes[0])["grpc_url"]
    before = served(state.nodes, state, "embedder")[1]
    points = perf_measure(
        grpc_url=grpc_url, model="embedder", version=1, concurrencies=(1, 2, 1), requests=REQUESTS
    )
    assert [p.concurrency for p in points] == [1, 2]
    for point in points:
        assert point.throughput > 0 and 0 < point.p50_ms <= point.p90_ms <= point.p99_ms
        assert point.compute_us > 0 and point.queue_us >= 0
    assert served(state.nodes, state, "embedder")[1] - before == 2 * REQUESTS


def test_a_failed_missing_or_late_run_says_why(
    node: tuple[Devfleet, FleetState], settings: object
) -> None:
    _, state = node
    grpc_url = state.node_urls(state.nodes[0])["grpc_url"]
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
