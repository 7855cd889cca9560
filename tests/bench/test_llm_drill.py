"""The judge on what users of a streamed answer feel, measured: three releases of the pipeline's
LLM step, each rolled out ROUNDS times, alternated, each from a fresh rag_pipeline v10 baseline
(its answer streamed by llm 1), on the trio of real Triton nodes under the demo's traffic read as
streams through HAProxy's gRPC frontend, judged by the statistical judge from a real Prometheus
by the real worker and beat:
- v11 (llm 2): healthy, as fast with the same answers;
- v12 (llm 3): its first token twice as slow, the whole answer as fast;
- v13 (llm 4): answers twice as long, each token as fast.

Reported: how many of each were rolled back (targets: no healthy one, every other one) and
on what. Asserted: only that every rollout ended.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_llm_drill.py -s -p no:cacheprovider`
"""

from collections import Counter

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.rollouts.models import Rollout
from tests.support.bench import Report
from tests.support.fleet import converged, judged_release, traffic_to, wait_for
from tests.support.services import Celery

ROUNDS = 5
# As the drill's (tests/bench/test_drill.py): the default statistical judge at a test's pace.
JUDGED = {"judge": "statistical", "interval_s": 2, "sample_s": 4, "window_s": 20, "warmup_s": 5}
STEPS_V10 = {("embedder", 2), ("retriever", 2), ("reranker", 2), ("llm", 1), ("rag_pipeline", 10)}
RELEASES = {
    11: ("healthy", "0 rolled back"),
    12: ("first token 2x slower, same total", "all rolled back"),
    13: ("answers 2x longer, same speed per token", "all rolled back"),
}


def failed_on(rollout: Rollout) -> str:
    """The metrics the rollout failed on, as its measurements say."""
    failed = rollout.measurements.filter(verdict="failure").values_list("metric", flat=True)
    return ", ".join(sorted(set(failed))) or "-"


@pytest.mark.timeout(3600)
@pytest.mark.django_db(transaction=True)
def test_the_judge_rolls_back_a_slower_first_token_and_longer_answers_and_no_healthy_release(
    pool: NodePool,
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    celery: Celery,
    report: Report,
) -> None:
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    deployment_set(model_name="rag_pipeline", version=10, pool=pool, actor="system:bench")
    wait_for("v10 is READY on every node", converged(pool, STEPS_V10), timeout=240)
    ended: dict[int, list[Rollout]] = {version: [] for version in RELEASES}
    with traffic_to(state, balancer=haproxy, rps=8):
        for _ in range(ROUNDS):
            for version in RELEASES:
                ended[version].append(
                    judged_release(pool, version, baseline=10, steps=STEPS_V10, analysis=JUDGED)
                )
    bench = f"the judge on streamed answers, {ROUNDS} releases each, alternated"
    for version, (label, target) in RELEASES.items():
        states = Counter(r.state for r in ended[version])
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
        report.add(bench, f"v{version}: {label}", counts, target)
        on = Counter(failed_on(r) for r in ended[version] if r.state == Rollout.State.ROLLED_BACK)
        for metrics, n in sorted(on.items()):
            report.add(bench, f"v{version} rolled back on", f"{metrics} ({n})", "")
    assert all(r.state != Rollout.State.PROGRESSING for rs in ended.values() for r in rs)
