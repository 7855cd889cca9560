"""A release to 5,000 simulated Triton nodes in 50 pools on 4 Celery queues, end to end, while
10 % of the nodes are replaced, with 2 and with 4 Celery worker processes, against a floor
measured side by side in the same run.

Product: `deployment_set` of rag_pipeline v1 on each of the 50 pools, whose nodes (found by
discovery, as a Kubernetes fleet's would be) are served by `apps.devtools.simulator` (a separate
process, 20 ms per load), until every node listed has its 5 loads (4 steps and the ensemble)
read back READY and serves, by real `celery worker --concurrency=N -Q <4 queues>` processes on
the test database and a private Redis. While the release runs, 500 nodes are replaced in 10
rounds: each round's targets listing (the shape of Prometheus' targets API) drops 50 nodes and
lists 50 new ones, read by the discovery's own `nodes_sync` (grace 0) and handed to the workers as
the discovery task does; each replacement joins out of traffic and must end up serving the
release. A real Prometheus' file_sd discovery is benchmarked in test_discovery.py; here its
scrapes of 5,500 targets would take the cores the release is measured on.

Floor: the same 5 loads per node, with the configs the product sent, each followed by an index
read, N nodes at a time, through the same client code, on a fresh simulator of 5,000 nodes (the
product also loads the replacements and some departed nodes: its work is larger). Targets: the
product within 1.5x the floor's time, its CPU per node (every process of the machine) within 3x
the floor's, 4 workers at least 1.8x faster than 2. Asserted: that the release finished after the
last replacement, that every listed node serves it, READY as read back from each node; the
ratios are reported against their targets, not asserted.

A gauge of the workers' part beside it, in seconds rather than a quarter of an hour
(`test_one_worker_cpu_per_node_against_the_floor`): one process' CPU per node for the same
release, task by task in-process, against the raw client's, with the statements it ran.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_reconcile_scale.py -s -p no:cacheprovider`
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count, Q
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.devtools.simulator import FLOOR_TIMEOUT_S, floor_load
from apps.fleet.discovery import nodes_sync
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.reconcile import node_reconcile
from apps.fleet.runner import node_run
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.fleet.tasks import (
    chunked,
    reconcile_change,
    reconcile_nodes,
)
from apps.fleet.triton import TritonClient
from apps.registry.imports import repository_import
from controlplane.celery import app as celery_app
from tests.support import REPOSITORY, ROOT
from tests.support.bench import Report
from tests.support.services import database_url

NODES = 5_000
POOLS = 50
QUEUES = [f"bench-q{q}" for q in range(4)]
REPLACED = NODES // 10
ROUNDS = 10  # the replacements arrive in rounds, ROUND_S apart, from the release's start
ROUND_S = 3.0
LOAD_MS = 20.0
LOADS_PER_NODE = 5  # embedder, retriever, reranker, generator, then the rag_pipeline ensemble
TARGET_RATIO = 1.5
TARGET_CPU_RATIO = 3.0
TARGET_SPEEDUP = 1.8
RELEASE_TIMEOUT_S = 1800.0
ACTOR = "system:bench"
BENCH = f"release to {NODES:,} nodes, {POOLS} pools, {REPLACED} replaced (sim load {LOAD_MS:g} ms)"

# workers -> (product seconds, floor seconds); the 4-worker run compares itself with the 2-worker one
RESULTS: dict[int, tuple[float, float]] = {}
Listed = dict[str, tuple[str, str]]  # node name -> (HTTP address, pool)


@contextmanager
def simulated(nodes: int) -> Iterator[list[str]]:
    """A fresh simulator process (its own GIL, not the benchmark's), on free ports."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.devtools.simulator",
            f"--nodes={nodes}",
            f"--load-ms={LOAD_MS}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        urls = []
        for line in proc.stdout:
            if match := re.match(r"node \d+: (\S+)", line):
                urls.append(match[1])
            elif line.startswith("ready:"):
                break
        assert len(urls) == nodes, f"the simulator did not start: exit {proc.poll()}"
        yield urls
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


@contextmanager
def celery_worker(workers: int, redis: str, log: Path) -> Iterator[Path]:
    """A prefork worker with `workers` processes (the integration `Celery` hard-codes 3) on the
    pools' queues; no beat: the benchmark triggers the reconcile and the discovery itself."""
    hostname = f"bench{workers}@{socket.gethostname()}"
    env = {**os.environ, "DATABASE_URL": database_url(), "CELERY_BROKER_URL": redis}
    command = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=prefork"]
    command += [f"--concurrency={workers}", "--without-mingle", "--without-gossip"]
    command += [f"--hostname={hostname}", "--loglevel=INFO", f"--queues={','.join(QUEUES)}"]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not celery_app.control.ping(timeout=0.5, destination=[hostname]):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"celery worker did not start; see {log}")
        yield log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def listing(listed: Listed) -> list[dict]:
    """`listed` as Prometheus' targets API lists its active targets (what `nodes_sync` reads)."""
    targets = []
    for name, (url, pool) in listed.items():
        port = url.rsplit(":", 1)[1]
        labels = {"node": name, "pool": pool, "http_port": port, "grpc_port": port}
        targets.append({"scrapeUrl": f"{url}/metrics", "labels": labels, "health": "up"})
    return targets


def discovered(listed: Listed) -> None:
    """One discovery pass over `listed`, its joining nodes handed to the workers as the
    discovery task hands them (tasks.discover_nodes)."""
    with override_settings(DISCOVERY_GRACE_S=0):
        found = nodes_sync(listing(listed), timezone.now())
    reconcile_change(found.joining)


def replace(listed: Listed, spares: list[str], rng: random.Random) -> list[str]:
    """REPLACED of the listed nodes replaced by spares, in ROUNDS rounds ROUND_S apart, each
    spare in the pool of the node it replaces; returns the nodes replaced."""
    gone = rng.sample(sorted(listed), REPLACED)
    per_round = REPLACED // ROUNDS
    for number in range(ROUNDS):
        time.sleep(ROUND_S)
        for name in gone[number * per_round : (number + 1) * per_round]:
            _, pool = listed.pop(name)
            spare = spares.pop()
            listed[f"new-{spare.rsplit(':', 1)[1]}"] = (spare, pool)
        discovered(listed)
    # A node departs on the pass after the one that first missed it (weight 0 meanwhile): the
    # next pass, ROUND_S later, departs the last round's.
    time.sleep(ROUND_S)
    discovered(listed)
    return gone


def wait_for_release(started: float) -> float:
    """Seconds from `started` until every node still listed serves, with its loads succeeded;
    fails on a failed load of a node still listed. Looked at in full only while no load is
    under way and no node joining: that look scans every node's loads, and the machine's CPU
    it takes would be counted as the product's."""
    listed = Node.objects.exclude(stage=Node.Stage.DEPARTED)
    ops = Operation.objects.filter(node__in=listed)
    loaded = Count("operations", filter=Q(operations__status=Operation.Status.SUCCEEDED))
    serving = listed.filter(stage=Node.Stage.SERVING).annotate(loaded=loaded)
    under_way = Operation.objects.filter(status__in=Operation.OPEN)
    joining = Node.objects.filter(stage=Node.Stage.JOINING)
    deadline = started + RELEASE_TIMEOUT_S
    while True:
        if not under_way.exists() and not joining.exists():
            if (done := serving.filter(loaded__gte=LOADS_PER_NODE).count()) >= NODES:
                return time.perf_counter() - started
            bad = ops.exclude(status__in=[Operation.Status.SUCCEEDED, *Operation.OPEN])
            assert not bad.exists(), list(
                bad.values("node__name", "model_name", "status", "error")[:5]
            )
            assert time.perf_counter() < deadline, (
                f"{done} of {NODES} nodes serve the release after {RELEASE_TIMEOUT_S:g} s"
            )
        assert time.perf_counter() < deadline, f"work still under way after {RELEASE_TIMEOUT_S:g} s"
        time.sleep(0.5)


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used (its busy time from /proc/stat): what
    the product and the floor each cost the cores they share, PostgreSQL and the simulator too."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    idle = int(fields[3]) + int(fields[4])  # idle and iowait
    return (sum(int(f) for f in fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> Counter[str]:
    """CPU seconds used so far by the machine's processes, by what they are: where the product's
    CPU goes. A process counts its ended children's too (PostgreSQL's backends, whose
    connections the workers replace every minute, are the postmaster's); those that ended with
    their parent meanwhile are not counted."""
    used: Counter[str] = Counter()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        kind = next((k for k in ("celery", "simulator", "postgres", "redis") if k in command), "")
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, and its children's
        used[kind or "others"] += ticks / os.sysconf("SC_CLK_TCK")
    return used


def not_ready(url: str, expected: set[tuple[str, int]]) -> set[tuple[str, int]]:
    index = TritonClient(url, timeout=FLOOR_TIMEOUT_S).repository_index()
    return expected - {(e.model, e.version) for e in index if e.state == "READY" and e.version}


def task_profile(log: Path) -> str:
    """Tasks run and their mean time, from the worker's own log."""
    times: dict[str, list[float]] = defaultdict(list)
    pattern = r"Task (\S+)\[[^\]]+\] succeeded in ([\d.]+)s"
    for name, seconds in re.findall(pattern, log.read_text(errors="replace")):
        times[name].append(float(seconds))
    retries = Counter(re.findall(r"Task (\S+)\[[^\]]+\] retry", log.read_text(errors="replace")))
    return ", ".join(
        f"{name} x{len(ts)} mean {sum(ts) / len(ts) * 1000:.0f} ms"
        + (f" ({retries[name]} retries)" if retries[name] else "")
        for name, ts in sorted(times.items())
    )


def query_shapes(queries: CaptureQueriesContext) -> str:
    """The most frequent statements by verb and first table: where the queries per node go."""
    shapes: Counter[str] = Counter()
    for query in queries.captured_queries:
        table = re.search(r'(?:FROM|INTO|UPDATE)\s+"(\w+)"', query["sql"])
        shapes[f"{query['sql'].split()[0]} {table[1] if table else ''}".strip()] += 1
    return ", ".join(f"{shape} x{count}" for shape, count in shapes.most_common(6))


@pytest.mark.timeout(3600)
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("workers", [2, 4])
def test_release_to_5000_nodes_against_the_floor(
    workers: int, redis_url: str, report: Report, tmp_path: Path
) -> None:
    celery_app.conf.broker_url = redis_url
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor=ACTOR))
    pools = [
        NodePool.objects.create(
            name=f"bench-{p:02}", queue=QUEUES[p % len(QUEUES)], discoverable=True
        )
        for p in range(POOLS)
    ]
    # The last one: a probe, run in this process afterwards.
    with simulated(NODES + REPLACED + 1) as urls:
        listed = {f"sim-{n:04}": (urls[n], pools[n % POOLS].name) for n in range(NODES)}
        # The fleet as it stands before the release: discovered, serving (nothing yet).
        nodes_sync(listing(listed), timezone.now())
        Node.objects.update(stage=Node.Stage.SERVING)
        spares = urls[NODES : NODES + REPLACED]
        with celery_worker(workers, redis_url, tmp_path / "worker.log") as log:
            started, started_at = time.perf_counter(), timezone.now()
            cpu = machine_cpu_s()
            by_process = cpu_by_process()
            for pool in pools:
                deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=ACTOR)
            gone = replace(listed, spares, random.Random(workers))
            replaced_by = time.perf_counter() - started
            product = wait_for_release(started)
            product_cpu_ms = (machine_cpu_s() - cpu) / NODES * 1000
            by_process = cpu_by_process() - by_process
        assert product > replaced_by, "the release ended before the last replacement"
        assert Node.objects.filter(name__in=gone, stage=Node.Stage.DEPARTED).count() == REPLACED
        first = Operation.objects.order_by("started_at").first()
        assert first is not None and first.started_at is not None
        sample = list(Operation.objects.filter(node__name="sim-0000").order_by("seq"))
        loads = [(op.model_name, _json(op.config)) for op in sample]
        expected = {(op.model_name, v) for op in sample for v in op.versions}
        assert len(loads) == LOADS_PER_NODE and len(expected) == LOADS_PER_NODE
        serving = [url for url, _ in listed.values()]
        with ThreadPoolExecutor(max_workers=16) as readers:
            missing = list(readers.map(lambda u: not_ready(u, expected), serving))
        assert not any(missing), [(u, m) for u, m in zip(serving, missing, strict=True) if m][:5]

        # One more node through the same code in this process, for the query count per node.
        probe = node_register(
            name="sim-probe",
            pool=pools[0].name,
            http_url=urls[-1],
            actor=ACTOR,
            grpc_url="",
            metrics_url="",
        )
        with CaptureQueriesContext(connection) as reconcile_queries:
            assert len(node_reconcile(node_id=probe.pk)) == LOADS_PER_NODE
        with CaptureQueriesContext(connection) as run_queries:
            t0 = time.perf_counter()
            node_run(node_id=probe.pk)
            probe_run_ms = (time.perf_counter() - t0) * 1000
        assert not_ready(urls[-1], expected) == set()
    first_load = (first.started_at - started_at).total_seconds()

    with simulated(NODES) as fresh:
        cpu = machine_cpu_s()
        raw = floor_load(fresh, loads, workers)
        floor_cpu_ms = (machine_cpu_s() - cpu) / NODES * 1000
    RESULTS[workers] = (product, raw)

    ratio = product / raw
    overhead_ms = (product - raw) * workers / NODES * 1000
    print(
        f"\n{workers} workers: product {product:.1f} s, floor {raw:.1f} s, ratio {ratio:.2f}x, "
        f"overhead {overhead_ms:.0f} ms per node per worker process, "
        f"first load after {first_load:.1f} s, replacements listed by {replaced_by:.1f} s, "
        f"machine CPU per node: product {product_cpu_ms:.0f} ms, floor {floor_cpu_ms:.0f} ms"
    )
    label = f"{workers} workers"
    report.add(BENCH, f"product, {label}", f"{product:.1f} s")
    report.add(
        BENCH, f"floor, {workers} in parallel (5 loads + index reads per node)", f"{raw:.1f} s"
    )
    report.add(BENCH, f"product / floor, {label}", f"{ratio:.2f}x", f"<= {TARGET_RATIO}x")
    report.add(BENCH, f"overhead per node per worker process, {label}", f"{overhead_ms:.0f} ms")
    report.add(BENCH, f"time to first load, {label}", f"{first_load:.1f} s")
    report.add(
        BENCH,
        f"machine CPU per node (all processes), {label}",
        f"product {product_cpu_ms:.0f} ms, floor {floor_cpu_ms:.0f} ms "
        f"({product_cpu_ms / floor_cpu_ms:.1f}x)",
        f"<= {TARGET_CPU_RATIO:g}x",
    )
    report.add(
        BENCH,
        f"its CPU per node by process, {label}",
        ", ".join(f"{k} {v / NODES * 1000:.0f} ms" for k, v in by_process.most_common(4)),
    )
    if len(RESULTS) == 1:  # the same code whatever the workers: one row for the session
        report.add(
            BENCH,
            "DB queries per node (reconcile + run, one node in-process)",
            f"{len(reconcile_queries)} + {len(run_queries)}",
        )
    if workers == 4 and 2 in RESULTS:
        speedup = RESULTS[2][0] / product
        report.add(BENCH, "4 workers against 2", f"{speedup:.2f}x faster", f">= {TARGET_SPEEDUP}x")
    if ratio > TARGET_RATIO:
        print(
            f"profile: {task_profile(log)}; first load after {first_load:.1f} s; "
            f"per node: {len(reconcile_queries)} queries to reconcile, {len(run_queries)} to run "
            f"(run alone: {probe_run_ms:.0f} ms vs {LOADS_PER_NODE * LOAD_MS:g} ms of loads)\n"
            f"  reconcile: {query_shapes(reconcile_queries)}\n  run: {query_shapes(run_queries)}"
        )


GAUGE_NODES = 100


@pytest.mark.django_db(transaction=True)
def test_one_worker_cpu_per_node_against_the_floor(report: Report) -> None:
    """The Celery workers' share of the release's CPU, without Celery: `reconcile_nodes` (plan
    and run, as a worker runs it) for a pool of GAUGE_NODES nodes, in the chunks a change to it
    is sent in, in this process, against `floor_load` of the same loads one node at a time; each
    counts this process' CPU only (the simulator is a process of its own). The statements it ran, the CPU spent
    executing them (the database driver) and PostgreSQL's own for them (its backend process) are
    reported beside it: where the rest goes is Python, the ORM's building of those statements
    most of all."""
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor=ACTOR))
    pool = NodePool.objects.create(name="gauge", discoverable=True)
    with simulated(GAUGE_NODES + 1) as urls:
        listed = {f"sim-{n:04}": (url, pool.name) for n, url in enumerate(urls)}
        nodes_sync(listing(listed), timezone.now())
        Node.objects.update(stage=Node.Stage.SERVING)
        deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=ACTOR)
        first, *ids = Node.objects.order_by("name").values_list("pk", flat=True)
        reconcile_nodes([first])  # computes the pool's desired state, as each worker does once
        statements, executing = 0, 0.0

        def counted(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
            nonlocal statements, executing
            started = time.process_time()
            try:
                return execute(sql, params, many, context)
            finally:
                statements += 1
                executing += time.process_time() - started

        started, database = time.process_time(), backend_cpu_s()
        with connection.execute_wrapper(counted):
            for chunk in chunked(ids):
                reconcile_nodes(chunk)
        product_ms = (time.process_time() - started) / len(ids) * 1000
        database_ms = (backend_cpu_s() - database) / len(ids) * 1000
        succeeded = Operation.objects.filter(status=Operation.Status.SUCCEEDED)
        assert succeeded.count() == LOADS_PER_NODE * (GAUGE_NODES + 1)
        sample = succeeded.filter(node_id=first).order_by("seq")
        loads = [(op.model_name, _json(op.config)) for op in sample]
    with simulated(GAUGE_NODES) as fresh:
        started = time.process_time()
        floor_load(fresh, loads, 1)
        floor_ms = (time.process_time() - started) / GAUGE_NODES * 1000
    gauge = f"one worker's CPU per node, in-process, {GAUGE_NODES} nodes"
    report.add(
        gauge,
        "reconcile_nodes against the raw client",
        f"product {product_ms:.1f} ms, floor {floor_ms:.1f} ms ({product_ms / floor_ms:.1f}x)",
    )
    report.add(
        gauge,
        "statements per node, CPU executing them, PostgreSQL's CPU",
        f"{statements / len(ids):.1f}, {executing / len(ids) * 1000:.1f} ms, {database_ms:.1f} ms",
    )


def backend_cpu_s() -> float:
    """CPU seconds this connection's PostgreSQL backend has used (a server on this machine)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _json(config: object) -> str | None:
    """What `runner._execute` sends as the config override."""
    return json.dumps(config) if config is not None else None
