"""Moves back on the demo's trio behind HAProxy, under its traffic through HAProxy, by the real
worker and beat: a one-click rollback inside the rollback window, a fallback to a version still
loaded (warm), and a rollback outside the window. Inside the window the release before is still
loaded beside the current one (as a promotion leaves it), so the rollback and the fallback only
narrow the version policy: every node at once, in traffic, nothing drained or warmed up; outside
it, the old versions load again, node by node out of traffic. Measured: from the click
(`release_rollback`, `release_fallback`) to every node read back serving v1 alone, pipeline and
steps, the bench reading each node's index every 0.1 s. Target for the narrowing moves: every
run under 2 s. The pipeline's v1 is deprecated first, as the release before a good one routinely
is: a move back goes to it all the same.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_rollback_window.py -s -p no:cacheprovider`
"""

import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from apps.rollouts.services import release_fallback, release_rollback
from tests.support.bench import Report
from tests.support.fleet import (
    STEPS_V1,
    STEPS_V2,
    converged,
    equal,
    settled,
    traffic_to,
    wait_for,
    weights,
)

ROUNDS = 2
TARGET_S = 2.0
MOVES: dict[str, Callable[..., int]] = {
    "rollback inside the window": release_rollback,
    "fallback to a warm version": release_fallback,
    "rollback outside the window": release_rollback,
}


def released(pool: NodePool, haproxy: Proc, state: FleetState, *, window: bool) -> None:
    """v2 on the pool as a promotion leaves it: v1 kept beside it for the window, or not; every
    node back in traffic."""
    until = timezone.now() + timedelta(minutes=10)
    deployment_set(
        model_name="rag_pipeline",
        version=2,
        pool=pool,
        baseline=1 if window else None,
        baseline_until=until if window else None,
        actor="system:bench",
    )
    on_it = settled(pool, STEPS_V2 | (STEPS_V1 if window else set()))
    wait_for(
        "v2 served, nothing open, every node in traffic",
        lambda: on_it() and weights(haproxy) == equal(state),
        300,
    )


def click_to_v1(pool: NodePool, move: Callable[..., int]) -> float:
    start = time.monotonic()
    assert move(model_name="rag_pipeline", pool_name=pool.name, actor="oncall") == 1
    done = converged(pool, STEPS_V1)
    while not done():
        assert time.monotonic() - start < 120, "the move back never reached every node"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.timeout(1800)
@pytest.mark.django_db(transaction=True)
def test_a_move_back_that_only_narrows_reaches_every_node_at_once(
    weighted: NodePool, trio: tuple[Devfleet, FleetState], haproxy: Proc, report: Report
) -> None:
    _, state = trio
    pool = weighted  # behind HAProxy, serving v1, every node in traffic
    Model.objects.filter(name="rag_pipeline").update(fallback_version=1)
    ModelVersion.objects.filter(model__name="rag_pipeline", version=1).update(
        status=ModelVersion.Status.DEPRECATED
    )
    times: dict[str, list[float]] = {label: [] for label in MOVES}
    with traffic_to(state, through=f"http://127.0.0.1:{haproxy.ports['http']}", rps=4):
        for _ in range(ROUNDS):
            for label, move in MOVES.items():
                released(pool, haproxy, state, window="outside" not in label)
                times[label].append(click_to_v1(pool, move))
    bench = "move back of rag_pipeline v2 → v1 on the trio behind HAProxy, click to every node"
    for label, found in times.items():
        value = f"{statistics.median(found):.2f} s (runs {', '.join(f'{t:.2f}' for t in found)})"
        narrows = "outside" not in label
        report.add(bench, label, value, f"< {TARGET_S:g} s" if narrows else "reported")
    slow = {label: found for label, found in times.items() if "outside" not in label}
    assert all(t < TARGET_S for found in slow.values() for t in found), slow
