"""A tuning release that proves it helps: on the demo's trio, the reranker made the pipeline's
bottleneck (one instance a node, 100 ms a request, as many users a node as three of its
batches), the pipeline's throughput and P99 as its users see them, before the advice "more
instances" and after its tuning rollout reached every node, by the real worker and beat.
Target: more requests a second after than before (the advice says throughput should rise), at a
P99 no worse.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_tuning.py -s -p no:cacheprovider`
"""

from collections import Counter

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool
from apps.observability.bottleneck import Advice
from apps.rollouts.models import Rollout
from apps.rollouts.tuning import tuning_start
from tests.support.bench import Report
from tests.support.fleet import (
    STEPS_V1,
    ready_on,
    saturating,
    until_state,
    wait_for,
)

DELAY_MS = 100
USERS_A_NODE = 24
MEASURE_S = 20.0
ADVICE = Advice(
    "reranker",
    "more instances: 1 -> 2",
    "the bench made it the bottleneck",
    "throughput rises",
    {"instance_group": [{"count": 2}]},
)


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_tuning_release_raises_the_pipelines_throughput(
    weighted: NodePool,
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    tuning_template: str,
    report: Report,
) -> None:
    devfleet, state = trio
    devfleet.fault("reranker", delay_ms=DELAY_MS)
    try:
        with saturating(state, per_node=USERS_A_NODE, haproxy=haproxy) as load:
            load.served(10)  # the queues fill
            before = load.served(MEASURE_S)
            rollout = tuning_start(
                pipeline="rag_pipeline",
                pool_name=weighted.name,
                advice=ADVICE,
                plan="1 node, hold 26s\n100%",
                template=tuning_template,
                actor="bench",
            )
            rollout = until_state(rollout, Rollout.State.SUCCEEDED, Rollout.State.ROLLED_BACK)
            assert rollout.state == Rollout.State.SUCCEEDED, rollout.reason
            tuned = STEPS_V1 - {("reranker", 1), ("rag_pipeline", 1)}
            tuned |= {("reranker", 7), ("rag_pipeline", 15)}
            serving = weighted.nodes.filter(stage=Node.Stage.SERVING)
            wait_for(
                "every serving node serves the tuned release",
                lambda: all(tuned <= ready_on(node) for node in serving),
                120,
            )
            load.served(10)
            after = load.served(MEASURE_S)
    finally:
        devfleet.fault("reranker")
    bench = (
        f"rag_pipeline on the trio, the reranker {DELAY_MS} ms a request, {USERS_A_NODE} users "
        "a node: before and after its tuning release (1 → 2 instances)"
    )
    report.add(
        bench,
        "throughput (requests/s, the pool)",
        f"{before[0]:.1f} → {after[0]:.1f} ({after[0] / before[0]:.2f}x)",
        "higher after",
    )
    stages = Counter(weighted.nodes.values_list("stage", flat=True))
    report.add(bench, "nodes after it, by stage", ", ".join(f"{n} {s}" for s, n in stages.items()))
    report.add(bench, "P99 as users see it", f"{before[1]:.0f} ms → {after[1]:.0f} ms", "no worse")
    assert after[0] > 1.3 * before[0] and after[1] <= before[1], (before, after)
