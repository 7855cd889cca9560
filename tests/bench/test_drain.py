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

import statistics
import time

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import POOL_BACKENDS, FleetState, Proc
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.pools import pool_set_traffic
from tests.support.bench import Report
from tests.support.fleet import (
    STEPS_V1,
    STEPS_V2,
    equal,
    recording,
    runtime,
    settled,
    wait_for,
    weights,
)
from tests.support.services import Celery

ROUNDS = 2
RPS = 20


def release(pool: NodePool, version: int, haproxy: Proc, state: FleetState) -> tuple[float, float]:
    """The pool to `version`; returns when it began and when every node was read back on it,
    with nothing open and every node at its full weight again."""
    began = time.monotonic()
    deployment_set(model_name="rag_pipeline", version=version, pool=pool, actor="system:bench")
    steps = STEPS_V2 if version == 2 else STEPS_V1
    on_it = settled(pool, steps)
    wait_for(
        f"the pool serves v{version}, nothing open, every node in traffic",
        lambda: on_it() and weights(haproxy) == equal(state),
        timeout=300,
    )
    return began, time.monotonic()


def strategy(pool: NodePool, haproxy: Proc, drained: bool) -> None:
    pool_set_traffic(
        pool_name=pool.name,
        traffic=NodePool.Traffic.HAPROXY if drained else NodePool.Traffic.NONE,
        runtime=runtime(haproxy).address,
        backends=list(POOL_BACKENDS),
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
    found: dict[bool, list[tuple[float, bool]]] = {True: [], False: []}
    took: dict[bool, list[float]] = {True: [], False: []}
    with recording(f"http://127.0.0.1:{haproxy.ports['http']}", rps=RPS) as recorder:
        time.sleep(5)  # steady state first
        for _ in range(ROUNDS):
            for drained in (True, False):
                strategy(pool, haproxy, drained)
                start, end = release(pool, 2, haproxy, state)
                found[drained] += recorder.between(start, end)
                took[drained].append(end - start)
                strategy(pool, haproxy, drained=True)
                release(pool, 1, haproxy, state)  # back, unmeasured
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
