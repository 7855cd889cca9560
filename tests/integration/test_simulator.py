"""The load-test simulator, driven through the product's own Triton client."""

import json
import re
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.devtools.simulator import Simulator, floor_load
from apps.fleet.node_metrics import read_metrics
from apps.fleet.triton import TritonClient, TritonRejected

ROOT = Path(__file__).parents[2]
# One line of Prometheus' text format: a name, optional labels, a number.
SAMPLE = re.compile(r'^([a-z_:][a-z0-9_:]*)(?:\{((?:[a-z_]+="[^"]*",?)*)\})? (-?[0-9.e+]+)$')


def versions(*numbers: int) -> str:
    """A config override as the product sends it (json_format writes int64 as strings)."""
    return json.dumps({"version_policy": {"specific": {"versions": [str(n) for n in numbers]}}})


def states(client: TritonClient) -> dict[tuple[str, int | None], tuple[str, str]]:
    return {(e.model, e.version): (e.state, e.reason) for e in client.repository_index()}


def metric_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in read_metrics(f"{url}/metrics", node="sim").splitlines():
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not Prometheus text format: {line!r}"
        labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', match[2] or ""))
        samples.append((match[1], labels, float(match[3])))
    return samples


@pytest.fixture
def simulator() -> Iterator[Simulator]:
    with Simulator([0, 0], load_ms=1) as sim:
        yield sim


def test_a_node_is_live_ready_and_reports_a_triton_version(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    assert client.health() == "ready"
    metadata = client.server_metadata()
    assert metadata.version == "2.51.0"
    assert "model_repository(unload_dependents)" in metadata.extensions


def test_a_load_serves_exactly_the_versions_its_override_names(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    assert client.repository_index() == []
    client.load("embedder", config_json=versions(1, 2))
    assert states(client) == {("embedder", 1): ("READY", ""), ("embedder", 2): ("READY", "")}
    client.load("embedder", config_json=versions(2))
    assert states(client) == {
        ("embedder", 1): ("UNAVAILABLE", "unloaded"),
        ("embedder", 2): ("READY", ""),
    }
    assert client.model_config("embedder")["version_policy"]["specific"]["versions"] == ["2"]


def test_a_load_without_an_override_serves_version_1(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    client.load("embedder")
    assert states(client) == {("embedder", 1): ("READY", "")}


def test_an_unload_makes_every_version_unavailable(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    client.load("embedder", config_json=versions(1, 2))
    client.unload("embedder", unload_dependents=True)
    assert states(client) == {
        ("embedder", 1): ("UNAVAILABLE", "unloaded"),
        ("embedder", 2): ("UNAVAILABLE", "unloaded"),
    }
    with pytest.raises(TritonRejected, match="'embedder' has no available versions"):
        client.model_config("embedder")


def test_a_failed_load_is_rejected_with_its_reason_in_the_index() -> None:
    with Simulator([0], failure_rate=1.0) as sim:
        client = TritonClient(sim.urls[0])
        with pytest.raises(
            TritonRejected,
            match=r"load failed for model 'embedder': version 1 is at UNAVAILABLE state: simulated",
        ):
            client.load("embedder")
        assert states(client) == {
            ("embedder", 1): ("UNAVAILABLE", "simulated load failure (failure_rate)")
        }


def test_a_failed_reload_leaves_the_serving_versions_as_they_were(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    client.load("embedder", config_json=versions(1))
    simulator.nodes[0].failure_rate = 1.0
    with pytest.raises(TritonRejected, match="load failed"):
        client.load("embedder", config_json=versions(2))
    assert states(client) == {
        ("embedder", 1): ("READY", ""),
        ("embedder", 2): ("UNAVAILABLE", "simulated load failure (failure_rate)"),
    }


def test_a_model_the_repository_lacks_is_rejected_like_triton() -> None:
    with Simulator([0], models={"embedder"}) as sim:
        client = TritonClient(sim.urls[0])
        assert states(client) == {("embedder", None): ("", "")}
        with pytest.raises(TritonRejected, match="failed to load 'ranker', failed to poll"):
            client.load("ranker")
        with pytest.raises(TritonRejected, match="is not found"):
            client.model_config("ranker")


def test_a_malformed_override_is_rejected(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    with pytest.raises(TritonRejected, match="failed to load 'embedder', failed to parse"):
        client.load("embedder", config_json="{not json")
    assert client.repository_index() == []


def test_nodes_are_independent_of_each_other(simulator: Simulator) -> None:
    first, second = (TritonClient(url) for url in simulator.urls)
    first.load("embedder", config_json=versions(3))
    second.load("ranker")
    assert states(first) == {("embedder", 3): ("READY", "")}
    assert states(second) == {("ranker", 1): ("READY", "")}


def test_metrics_parse_and_list_each_ready_version(simulator: Simulator) -> None:
    client = TritonClient(simulator.urls[0])
    client.load("embedder", config_json=versions(1, 2))
    client.load("embedder", config_json=versions(2))
    samples = metric_samples(simulator.urls[0])
    names = {name for name, _, _ in samples}
    assert {"nv_cpu_memory_used_bytes", "nv_cpu_utilization"} <= names
    for metric in (
        "nv_inference_request_success",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
    ):
        assert [labels for name, labels, _ in samples if name == metric] == [
            {"model": "embedder", "version": "2"}
        ]
    p99 = [v for n, labels, v in samples if labels.get("quantile") == "0.99"]
    assert p99 == [2500.0]
    idle = {name for name, _, _ in metric_samples(simulator.urls[1])}
    assert idle == {"nv_cpu_utilization", "nv_cpu_memory_used_bytes", "nv_cpu_memory_total_bytes"}


def test_five_thousand_nodes_start_in_one_process_and_each_answers() -> None:
    """The fleet size issue 30 drives: one asyncio process, its descriptors raised to the hard
    limit as the command line does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        with Simulator([0] * 5000) as sim:
            assert len(set(sim.ports)) == 5000
            for url in sim.urls[::499]:
                assert TritonClient(url).health() == "ready"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_fifty_nodes_answer_while_each_holds_a_load_in_flight() -> None:
    """Every node's reranker load hangs, unanswered, while its embedder loads and reads back:
    one node's request in flight blocks neither that node nor the others."""
    with Simulator([0] * 50, load_ms=20, hang={"reranker"}) as sim:
        hung = [socket.create_connection((sim.host, port)) for port in sim.ports]
        try:
            for sock in hung:
                sock.sendall(
                    b"POST /v2/repository/models/reranker/load HTTP/1.1\r\n"
                    b"Host: sim\r\nContent-Length: 0\r\n\r\n"
                )
            floor_load(sim.urls, [("embedder", versions(1))], concurrency=25)
            for url in sim.urls:
                assert states(TritonClient(url)) == {
                    ("embedder", 1): ("READY", ""),
                    ("reranker", 1): ("LOADING", ""),
                }
        finally:
            for sock in hung:
                sock.close()


def test_a_taken_port_fails_start() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(OSError):
            Simulator([sock.getsockname()[1]]).start()


def test_the_command_line_prints_each_node_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "apps.devtools.simulator", "--nodes", "3", "--load-ms", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]
        assert lines[3] == "ready: 3 simulated Triton nodes\n"
        url = re.search(r"http://\S+", lines[2])
        assert url and TritonClient(url[0]).health() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == "stopped on SIGTERM\n"
    finally:
        proc.kill()
        proc.wait()
