"""The performance gate, measured: on the trio of real Triton nodes behind HAProxy, under the
demo's traffic, two releases of the pipeline each rolled out ROUNDS times from rag_pipeline v15
(its reranker: 40 ms a request, two instances; tests/support/perf_drills), alternated, with the
gate at 4 users and its default tolerances, by the real worker:
- v16: its reranker with one instance: as fast alone, half the requests a second at 4 users;
- v17: v15's very steps: healthy.

Reported: the verdicts (targets: every v16 stopped before any traffic, no v17), how long the
gate took from the canary READY to its verdict (target: 90 s at most), and each side's
throughput. Asserted: no wrong verdict, and the time.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_perf_gate.py -s -p no:cacheprovider`
"""

from pathlib import Path
from statistics import median

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.performance.models import PerfRun
from apps.quality.services import evaluation_set_import
from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import rollout_abort
from tests.support.bench import Report
from tests.support.fleet import (
    STEPS_V15,
    settled,
    traffic_to,
    until_state,
    wait_for,
    with_perf_drills,
)
from tests.support.quality import DEMO_SET
from tests.support.services import Celery

ROUNDS = 5
GATE = {"perf_concurrency": "4", "interval_s": 2, "window_s": 10, "warmup_s": 5}
SLOWER, HEALTHY = 16, 17
MAX_GATE_S = 90


@pytest.fixture(scope="module", autouse=True)
def drills(repository: Path) -> None:
    """Before the pool imports the repository: the performance gate's drills in it."""
    with_perf_drills(repository)


def gated(pool: NodePool, version: int) -> tuple[Rollout, float]:
    """One release from a fresh v15, to the gate's verdict; then back to v15. Returns the
    rollout and the gate's time from its first run to its verdict."""
    wait_for("a fresh v15 baseline, nothing open", settled(pool, STEPS_V15), timeout=180)
    rollout = rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=version,
        plan="1 node, hold 10m\n100%",
        analysis=GATE,
        actor="release-manager",
    )
    found = Rollout.objects.filter(pk=rollout.pk)
    judged = Round.objects.filter(rollout=rollout, kind=Round.Kind.PERF)
    wait_for(
        f"rollout #{rollout.pk}'s gate decided",
        lambda: judged.exists() or found.get().state == Rollout.State.PAUSED,
        timeout=300,
    )
    first = PerfRun.objects.filter(purpose__startswith=f"rollout #{rollout.pk},").earliest("id")
    verdict = judged.first()
    took = (verdict.taken_at - first.created_at).total_seconds() if verdict else float("inf")
    if found.get().active:
        rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    return until_state(rollout, Rollout.State.ROLLED_BACK), took


@pytest.mark.timeout(3600)
@pytest.mark.django_db(transaction=True)
def test_the_gate_stops_every_release_slower_under_load_and_no_healthy_one(
    weighted: NodePool,
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    celery: Celery,
    report: Report,
) -> None:
    _, state = trio
    text = DEMO_SET.read_text()
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="bench")
    deployment_set(model_name="rag_pipeline", version=15, pool=weighted, actor="system:bench")
    ended: dict[int, list[tuple[Rollout, float]]] = {SLOWER: [], HEALTHY: []}
    with traffic_to(state, balancer=haproxy, rps=8):
        for _ in range(ROUNDS):
            for version in ended:
                ended[version].append(gated(weighted, version))
    bench = f"the performance gate, {ROUNDS} + {ROUNDS} releases alternated"
    stopped = {v: sum("performance gate failed" in r.reason for r, _ in ended[v]) for v in ended}
    report.add(
        bench,
        "v16 (one reranker instance) stopped before traffic",
        f"{stopped[SLOWER]}/{ROUNDS}",
        f"{ROUNDS}/{ROUNDS}",
    )
    report.add(bench, "v17 (healthy) stopped", f"{stopped[HEALTHY]}/{ROUNDS}", "0")
    times = [took for runs in ended.values() for _, took in runs]
    report.add(
        bench,
        "gate: canary READY -> verdict",
        f"median {median(times):.0f} s, max {max(times):.0f} s",
        f"<= {MAX_GATE_S} s",
    )
    for version in ended:
        rates = Measurement.objects.filter(
            rollout__in=[r for r, _ in ended[version]], metric="throughput at concurrency 4"
        )
        canary = median(m.canary_value for m in rates)
        baseline = median(m.baseline_value for m in rates)
        report.add(
            bench,
            f"v{version} requests/s at 4 users, median",
            f"{canary:.1f} vs v15 {baseline:.1f}",
        )
    assert stopped == {SLOWER: ROUNDS, HEALTHY: 0}
    assert max(times) <= MAX_GATE_S
