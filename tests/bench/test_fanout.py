"""A release fanned out to 3 and to 6 real Triton nodes, against a floor measured side by side.

Product: `deployment_set` of rag_pipeline v2 on a pool serving v1, until every node's repository
index reads back STEPS_V2 READY (each node polled every 0.1 s), through the real worker (prefork, 3
processes) and beat of the integration fixtures. Floor: with the worker paused, the loads the
product sent to each node, in its make-before-break order and with its configs (steps at [1, 2],
the ensemble v2, steps narrowed to [2]), each followed by an index read, 3 nodes at a time (the
worker's concurrency), through the same client. Product and floor alternate, ROUNDS each, and
each starts from the same v1; medians are reported. Target: the product costs at most 1.2x the
floor. Asserted: only that every switch completed and was read back; the ratio is reported.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_fanout.py -s -p no:cacheprovider`
"""

import json
import re
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import pytest
from django.utils import timezone

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.fleet.triton import TritonClient
from apps.registry.imports import repository_import
from controlplane.celery import app as celery_app
from tests.support.bench import Report
from tests.support.fleet import STEPS_V1, STEPS_V2, ready_on, settled, wait_for
from tests.support.services import Celery

ROUNDS = 3
WORKERS = 3  # the integration worker's --concurrency
TARGET_RATIO = 1.2
POLL_S = 0.1
SWITCH_TIMEOUT_S = 300.0
ACTOR = "system:bench"

Loads = list[tuple[str, str | None]]  # (model, config JSON) in the order the product sent them


@pytest.fixture(scope="module", params=[3, 6], ids=lambda n: f"{n}-nodes")
def fanout_fleet(
    request: pytest.FixtureRequest, repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Devfleet, FleetState]]:
    """Each size started once, the 3 nodes stopped before the 6 start."""
    nodes: int = request.param
    devfleet = Devfleet(home=tmp_path_factory.mktemp(f"fanout{nodes}"), repository=repository)
    state = devfleet.up(nodes=nodes, pool=f"fanout{nodes}", base_port=None, prometheus_port=None)
    try:
        yield devfleet, state
    finally:
        devfleet.down()


def switched(pool: NodePool, expected: set[tuple[str, int]]) -> None:
    """Every node reads back `expected` and the worker has nothing left to do for them, none
    of it failed."""
    wait_for(
        "the pool converged with no open operation",
        settled(pool, expected),
        timeout=SWITCH_TIMEOUT_S,
    )
    ops = Operation.objects.filter(node__pool=pool)
    bad = ops.exclude(status__in=[Operation.Status.SUCCEEDED, Operation.Status.CANCELLED])
    assert not bad.exists(), list(bad.values("node__name", "model_name", "status", "error")[:5])


def product_switch(pool: NodePool, nodes: list[Node], version: int, expected: set) -> float:
    """Seconds from `deployment_set` until every node's index reads back `expected`."""
    pending = list(nodes)
    started = time.perf_counter()
    deployment_set(model_name="rag_pipeline", version=version, pool=pool, actor=ACTOR)
    while pending:
        assert time.perf_counter() - started < SWITCH_TIMEOUT_S, [n.name for n in pending]
        pending = [n for n in pending if ready_on(n) != expected]
        if pending:
            time.sleep(POLL_S)
    return time.perf_counter() - started


def profile(nodes: list[Node], mark: int, started_at: datetime) -> tuple[float, float, float]:
    """Where a product switch spent its time, summed over nodes: waiting for its first load, in
    loads (sent to read back), and between them (the product's own work per operation)."""
    waiting = loading = between = 0.0
    for node in nodes:
        ops = Operation.objects.filter(node=node, id__gt=mark, status=Operation.Status.SUCCEEDED)
        rows = ops.order_by("started_at").values_list("started_at", "finished_at")
        times = [(start, end) for start, end in rows if start and end]  # succeeded: both set
        waiting += (times[0][0] - started_at).total_seconds()
        loading += sum((end - start).total_seconds() for start, end in times)
        between += sum((after[0] - before[1]).total_seconds() for before, after in pairwise(times))
    return waiting, loading, between


def retries(log: Path, offset: int) -> int:
    """run_node retries the worker logged after `offset` (another run_node held the node)."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    return len(re.findall(r"Task fleet\.run_node\[[^\]]+\] retry", text))


def loads_since(nodes: list[Node], mark: int) -> dict[str, Loads]:
    """What the product sent to each node after operation `mark`, in the order it ran."""
    sent = {}
    for node in nodes:
        ops = Operation.objects.filter(node=node, id__gt=mark, status=Operation.Status.SUCCEEDED)
        sent[node.http_url] = [
            (op.model_name, json.dumps(op.config) if op.config is not None else None)
            for op in ops.order_by("started_at", "id")
        ]
        assert not ops.exclude(kind=Operation.Kind.LOAD).exists()
    return sent


def floor_switch(loads: dict[str, Loads], expected: set[tuple[str, int]]) -> float:
    """The product's loads with nothing of it in between: each load then an index read, one node's
    loads in a row, WORKERS nodes at a time."""

    def release(url: str) -> None:
        client = TritonClient(url)
        for model, config_json in loads[url]:
            client.load(model, config_json=config_json)
            client.repository_index()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=WORKERS) as executor:
        list(executor.map(release, loads))
    seconds = time.perf_counter() - started
    for url in loads:
        index = TritonClient(url).repository_index()
        assert {(e.model, e.version) for e in index if e.state == "READY" and e.version} == (
            expected
        ), url
    return seconds


def backlog_drained() -> None:
    """The periodic tasks beat queued while the worker was paused, run before the next product
    switch, so that it does not queue behind them: a backlog the pause made, not the product."""
    with celery_app.connection_for_write() as conn:
        client = conn.default_channel.client  # type: ignore[attr-defined]  # kombu's Redis
        wait_for("the worker's queue is empty", lambda: client.llen("celery") == 0, timeout=60)
    time.sleep(3)  # what the worker took from it


def last_op_id() -> int:
    return Operation.objects.order_by("-id").values_list("id", flat=True).first() or 0


@pytest.mark.timeout(1800)
@pytest.mark.django_db(transaction=True)
def test_fanout_of_a_release_against_raw_parallel_loads(
    fanout_fleet: tuple[Devfleet, FleetState],
    repository: Path,
    celery: Celery,
    report: Report,
) -> None:
    began = time.perf_counter()
    _, state = fanout_fleet
    size = len(state.nodes)
    name = f"fanout{size}"
    for proc in state.nodes:
        node_register(name=proc.name, pool=name, actor=ACTOR, **state.node_urls(proc))
    assert all(r.ok for r in repository_import(path=repository, actor=ACTOR))
    pool = NodePool.objects.get(name=name)
    nodes = list(pool.nodes.order_by("name"))
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=ACTOR)
    switched(pool, STEPS_V1)

    product: list[float] = []
    floor: list[float] = []
    first_loads: list[float] = []
    profiles: list[tuple[float, float, float]] = []
    busy: list[int] = []
    log = celery.root / "worker.log"
    forward: dict[str, Loads] = {}
    backward: dict[str, Loads] = {}
    for _ in range(ROUNDS):
        mark, started_at, offset = last_op_id(), timezone.now(), log.stat().st_size
        product.append(product_switch(pool, nodes, 2, STEPS_V2))
        switched(pool, STEPS_V2)
        busy.append(retries(log, offset))
        profiles.append(profile(nodes, mark, started_at))
        first = Operation.objects.filter(id__gt=mark).order_by("started_at").first()
        assert first is not None and first.started_at is not None
        first_loads.append((first.started_at - started_at).total_seconds())
        forward = forward or loads_since(nodes, mark)
        mark = last_op_id()
        deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=ACTOR)
        switched(pool, STEPS_V1)  # back to v1 by the product, untimed
        backward = backward or loads_since(nodes, mark)

        # The floor with the worker paused: the desired state says v1, so a reconcile in the middle
        # would undo it. It ends on v1 with the product's own v1 configs, so nothing drifts.
        celery.pause()
        mark = last_op_id()
        try:
            floor.append(floor_switch(forward, STEPS_V2))
            floor_switch(backward, STEPS_V1)
        finally:
            celery.resume()
        assert last_op_id() == mark, "the product acted on the nodes during the floor"
        backlog_drained()

    loads_per_node = len(next(iter(forward.values())))
    p, f = statistics.median(product), statistics.median(floor)
    ratio = p / f
    per_node_ms = (p - f) * min(WORKERS, size) / size * 1000
    runtime = time.perf_counter() - began
    print(
        f"\n{size} nodes: product {_list(product)}, floor {_list(floor)}, ratio {ratio:.2f}x, "
        f"overhead {per_node_ms:.0f} ms per node ({loads_per_node} loads each), "
        f"first load after {_list(first_loads)}, runtime {runtime:.0f} s; per round, summed "
        "over nodes, seconds waiting for the first load / in loads / between loads: "
        + ", ".join(f"{w:.1f} / {i:.1f} / {b:.1f}" for w, i, b in profiles)
        + f"; run_node retries (NodeBusy) per round: {busy}"
    )
    bench = f"fan-out v1->v2 to {size} Triton nodes"
    report.add(bench, f"product, median of {ROUNDS} (deployment_set -> all READY)", f"{p:.2f} s")
    report.add(
        bench,
        f"floor, median of {ROUNDS} ({loads_per_node} loads + index reads per node, "
        f"{WORKERS} nodes at a time)",
        f"{f:.2f} s",
    )
    report.add(bench, "product / floor", f"{ratio:.2f}x", f"<= {TARGET_RATIO}x")
    report.add(
        bench,
        "overhead per node (per load)",
        f"{per_node_ms:.0f} ms ({per_node_ms / loads_per_node:.0f} ms)",
    )
    report.add(bench, "time to first load, median", f"{statistics.median(first_loads):.2f} s")
    between = statistics.median(b / size / loads_per_node for _, _, b in profiles) * 1000
    report.add(bench, "product's gap between loads on a node, median", f"{between:.0f} ms")
    report.add(
        bench, "run_node retries (NodeBusy) per switch, median", f"{statistics.median(busy)}"
    )
    report.add(bench, "bench runtime (fleet start excluded)", f"{runtime:.0f} s")


def _list(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "] s"
