"""Live requests during a release, with and without draining each node before its load: the trio
of real Triton nodes behind a real HAProxy under steady traffic (rag_pipeline through HAProxy's
HTTP frontend), the same release v1 -> v2 rolled over the whole pool by the real worker, once
with the pool's `haproxy` traffic strategy (each node drained, loaded, warmed up, back) and once
without (HAProxy keeps sending each node its share while it loads), alternated over ROUNDS.

Reported: P99 and failed requests among those sent while each release was under way (from the
change of desired state to every node read back on v2 and back in traffic). Asserted: every
release completes, and no request fails during a drained one.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_drain.py -s -p no:cacheprovider`
"""

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from apps.fleet.devfleet import HAPROXY_BACKENDS, Devfleet, FleetState, Proc
from apps.fleet.models import NodePool, Operation
from apps.fleet.services import deployment_set, pool_set_traffic
from apps.fleet.traffic import sample_inputs, wait_for_model
from apps.fleet.triton import TritonClient, TritonError
from tests.support.bench import Report
from tests.support.fleet import STEPS_V1, STEPS_V2, converged, equal, runtime, wait_for, weights
from tests.support.services import Celery

ROUNDS = 2
RPS = 20
OPEN = [Operation.Status.QUEUED, Operation.Status.RUNNING]


@dataclass
class Recorder:
    """Steady unversioned rag_pipeline requests through HAProxy: when each was sent, how long it
    took, whether it failed."""

    url: str
    sent: list[tuple[float, float, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = TritonClient(self.url, node="haproxy")
        spec = wait_for_model(client, "rag_pipeline", timeout=60)
        rng = random.Random(0)

        def one(at: float) -> None:
            try:
                client.infer("rag_pipeline", sample_inputs(spec, rng))
                ok = True
            except TritonError:
                ok = False
            self.sent.append((at, time.monotonic() - at, ok))

        with ThreadPoolExecutor(max_workers=16) as pool:
            start = time.monotonic()
            for number in range(10**9):
                if self.stop.is_set():
                    break
                time.sleep(max(0.0, start + number / RPS - time.monotonic()))
                pool.submit(one, time.monotonic())

    def between(self, start: float, end: float) -> list[tuple[float, bool]]:
        return [(took, ok) for at, took, ok in list(self.sent) if start <= at <= end]


def release(pool: NodePool, version: int, haproxy: Proc, state: FleetState) -> tuple[float, float]:
    """The pool to `version`; returns when it began and when every node was read back on it,
    with nothing open and every node at its full weight again."""
    began = time.monotonic()
    deployment_set(model_name="rag_pipeline", version=version, pool=pool, actor="system:bench")
    steps = STEPS_V2 if version == 2 else STEPS_V1
    ops = Operation.objects.filter(node__pool=pool)
    on_it = converged(pool, steps)
    wait_for(
        f"the pool serves v{version}, nothing open, every node in traffic",
        lambda: (
            on_it()
            and not ops.filter(status__in=OPEN).exists()
            and weights(haproxy) == equal(state)
        ),
        timeout=300,
    )
    return began, time.monotonic()


def strategy(pool: NodePool, haproxy: Proc, drained: bool) -> None:
    pool_set_traffic(
        pool_name=pool.name,
        traffic=NodePool.Traffic.HAPROXY if drained else NodePool.Traffic.NONE,
        runtime=runtime(haproxy).address,
        backends=list(HAPROXY_BACKENDS),
        min_serving=2,
        actor="system:bench",
    )


@pytest.mark.timeout(1500)
@pytest.mark.django_db(transaction=True)
def test_draining_before_loads_keeps_live_requests_fast_and_whole(
    pool: NodePool,
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    celery: Celery,
    report: Report,
) -> None:
    _, state = trio
    strategy(pool, haproxy, drained=True)
    release(pool, 1, haproxy, state)
    recorder = Recorder(f"http://127.0.0.1:{haproxy.ports['http']}")
    thread = threading.Thread(target=recorder.run, daemon=True)
    thread.start()
    found: dict[bool, list[tuple[float, bool]]] = {True: [], False: []}
    took: dict[bool, list[float]] = {True: [], False: []}
    try:
        time.sleep(5)  # steady state first
        for _ in range(ROUNDS):
            for drained in (True, False):
                strategy(pool, haproxy, drained)
                start, end = release(pool, 2, haproxy, state)
                found[drained] += recorder.between(start, end)
                took[drained].append(end - start)
                strategy(pool, haproxy, drained=True)
                release(pool, 1, haproxy, state)  # back, unmeasured
    finally:
        recorder.stop.set()
        thread.join(30)
    bench = f"release v1 -> v2 on the trio behind HAProxy, {RPS} req/s ({ROUNDS} rounds each)"
    for drained, label in ((True, "drained before each load"), (False, "loaded under traffic")):
        latencies = sorted(t for t, ok in found[drained] if ok)
        failed = sum(1 for _, ok in found[drained] if not ok)
        p99 = latencies[int(0.99 * (len(latencies) - 1))] * 1000 if latencies else float("nan")
        report.add(
            bench,
            f"{label}: P99 / failed of {len(found[drained])} requests",
            f"{p99:.0f} ms / {failed}",
            "no failed request" if drained else "",
        )
        report.add(
            bench, f"{label}: release took, median", f"{statistics.median(took[drained]):.1f} s"
        )
    assert found[True] and found[False]
    assert all(ok for _, ok in found[True]), "a request failed during a drained release"
