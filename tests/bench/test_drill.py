"""False verdicts, measured: the healthy rag_pipeline v2 and the slow v3 (+250 ms on every
request) each rolled out ROUNDS times on the trio of real Triton nodes under the demo's traffic
(4 requests a second over 3 nodes), each from a fresh v1 baseline, judged by the statistical judge
from a real Prometheus by the real worker and beat. A judge that rolls a healthy release back is
worse than none: people stop trusting it.

Reported: how many healthy releases were rolled back (target 0) and how many slow ones were
(target all), with each rollout's reason. Asserted: only that every rollout ended.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_drill.py -s -p no:cacheprovider`
"""

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.rollouts.models import Rollout
from tests.support.bench import Report
from tests.support.fleet import STEPS_V1, converged, judged_release, traffic_to, wait_for
from tests.support.services import Celery

ROUNDS = 5
# The default analysis (the statistical judge) at the pace of a test: every 2 s, 4 s samples
# over the last 20 s, after a 5 s warm-up; otherwise the defaults (confidence, tolerances, pass
# score, limits).
JUDGED = {"interval_s": 2, "sample_s": 4, "window_s": 20, "warmup_s": 5}


@pytest.mark.timeout(3600)
@pytest.mark.django_db(transaction=True)
def test_the_judge_rolls_back_no_healthy_release_and_every_slow_one(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery, report: Report
) -> None:
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:bench")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))  # before any traffic
    ended: dict[int, list[Rollout]] = {2: [], 3: []}
    with traffic_to(state, rps=4):
        for _ in range(ROUNDS):
            for version in (2, 3):
                ended[version].append(
                    judged_release(pool, version, baseline=1, steps=STEPS_V1, analysis=JUDGED)
                )
    bench = f"the statistical judge, {ROUNDS} releases each of v2 (healthy) and v3 (+250 ms)"
    for version, label, target in ((2, "healthy", "0 rolled back"), (3, "slow", "all rolled back")):
        states = [r.state for r in ended[version]]
        counts = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
        report.add(bench, f"{label} releases", counts, target)
    for r in ended[2]:
        if r.state != Rollout.State.SUCCEEDED:
            report.add(bench, f"healthy #{r.pk} {r.state}", r.reason[:120])
