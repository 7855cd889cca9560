"""One-click rollback inside and outside the rollback window, on the trio of real Triton nodes
under the demo's traffic, by the real worker and beat. Inside the window the release before is
still loaded beside the current one (as a promotion leaves it), so the rollback only narrows the
version policy; outside it, the old versions load again. Measured: from the click
(`release_rollback`) to every node read back serving v1 alone, pipeline and steps, the bench
reading each node's index every 0.1 s. Target inside the window: under 2 s.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_rollback_window.py -s -p no:cacheprovider`
"""

import statistics
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet.devfleet import Devfleet, FleetState
from apps.fleet.models import NodePool
from apps.fleet.services import deployment_set
from apps.rollouts.services import release_rollback
from tests.support.bench import Report
from tests.support.fleet import STEPS_V1, STEPS_V2, converged, traffic_to, wait_for
from tests.support.services import Celery

ROUNDS = 2
TARGET_S = 2.0


def released(pool: NodePool, *, window: bool) -> None:
    """v2 on the pool as a promotion leaves it: v1 kept beside it for the window, or not."""
    until = timezone.now() + timedelta(minutes=10)
    deployment_set(
        model_name="rag_pipeline",
        version=2,
        pool=pool,
        baseline=1 if window else None,
        baseline_until=until if window else None,
        actor="system:bench",
    )
    wait_for("v2 served", converged(pool, STEPS_V2 | (STEPS_V1 if window else set())), 180)


def click_to_v1(pool: NodePool) -> float:
    start = time.monotonic()
    assert release_rollback(model_name="rag_pipeline", pool_name=pool.name, actor="oncall") == 1
    done = converged(pool, STEPS_V1)
    while not done():
        assert time.monotonic() - start < 120, "the rollback never reached every node"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.timeout(1800)
@pytest.mark.django_db(transaction=True)
def test_a_rollback_inside_the_window_only_narrows(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery, report: Report
) -> None:
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:bench")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1), 180)
    times: dict[bool, list[float]] = {True: [], False: []}
    with traffic_to(trio[1], rps=4):
        for _ in range(ROUNDS):
            for window in (True, False):
                released(pool, window=window)
                times[window].append(click_to_v1(pool))
    bench = "one-click rollback of rag_pipeline v2 → v1, click to every node on v1 alone"
    for window, label in ((True, "inside the window"), (False, "outside it")):
        found = times[window]
        value = f"{statistics.median(found):.2f} s (runs {', '.join(f'{t:.2f}' for t in found)})"
        report.add(bench, label, value, f"< {TARGET_S:g} s" if window else "reported")
