"""Blue-green releases of the pipeline's knowledge base on 3 real Triton nodes behind a real
HAProxy, under 20 requests/s through it, the real worker running the controller: a re-indexed
retriever loads beside the one serving, is evaluated on every node, and every node switches; an
index built from the wrong documents is evaluated, let go, and never answers a user; one that
fails users' requests once switched is rolled back by itself."""

import time

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.quality.models import EvaluationRun
from apps.quality.services import evaluation_set_import
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.proposals import rollout_start
from tests.support import ROOT
from tests.support.fleet import (
    HEALTHY,
    counted,
    equal,
    ready_on,
    recording,
    served,
    tick_until,
    wait_for,
    weights,
)
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

State = Rollout.State
RPS = 20
STEP_SET = (ROOT / "deploy" / "evaluations" / "retriever-faq.jsonl").read_text()


def start(pool: NodePool, canary: int, **analysis: object) -> Rollout:
    evaluation_set_import(model_name="retriever", name="faq", text=STEP_SET, actor="ci")
    return rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=canary,
        plan="",
        analysis={**HEALTHY, "quality_set": "faq", "quality_timeout_s": 10, **analysis},
        actor="release-manager",
        strategy=Rollout.Strategy.BLUE_GREEN,
    )


def pipeline_and_retriever(pool: NodePool) -> set[frozenset[tuple[str, int]]]:
    """What each node serves of the pipeline and its retriever, by its own index."""
    return {
        frozenset(p for p in ready_on(node) if p[0] in ("rag_pipeline", "retriever"))
        for node in pool.nodes.all()
    }


def test_an_index_from_the_wrong_documents_is_let_go_and_never_answers_a_user(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState], celery: Celery
) -> None:
    _, state = trio
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    with celery.holding_rollouts(), recording(balancer, rps=RPS) as recorder:
        rollout = start(weighted, canary=9)  # v1 with retriever 4
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        tick_until("evaluating", rollout, lambda: current().gate_runs.count() == 3, 180)
        runs = current().gate_runs.all()
        wait_for("every node's run finished", lambda: all(r.finished for r in runs.all()))
        # Between two ticks nothing else moves: retriever 4 answered its warm-up once loaded and
        # its evaluations (30 cases) on each node, and not one user request, by Triton's own
        # counters.
        asked = weighted.warmup_requests + 30
        answered = counted(state.nodes, state, "retriever", 4, asked * len(state.nodes))
        assert answered[4] == asked * len(state.nodes)
        tick_until("rolled back", rollout, lambda: current().state == State.ROLLED_BACK, 180)
    assert recorder.failed == 0
    rollout.refresh_from_db()
    assert rollout.reason.startswith(
        "failed before the switch, still serving the release before: quality before the switch:"
        " retriever: trio-1: canary scored 27% (8 of 30 cases), below 90%"
    )
    assert pipeline_and_retriever(weighted) == {frozenset({("rag_pipeline", 1), ("retriever", 1)})}
    assert weights(haproxy) == equal(state)


def test_a_switched_release_that_fails_users_requests_rolls_back_by_itself(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    """Its evaluation passed; once every node serves it, its retriever fails half of what it
    is asked (a fault, as a broken index would): the release before, still loaded, serves
    again on every node, without a person."""
    devfleet, _ = trio
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    try:
        with recording(balancer, rps=RPS):
            rollout = start(weighted, canary=8, switch_hold_s=60, min_requests=20)
            current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
            wait_for("switching", lambda: current().state == State.PROMOTING, timeout=180)
            devfleet.fault("retriever", error_rate=0.5)
            wait_for("rolled back", lambda: current().state == State.ROLLED_BACK, timeout=120)
    finally:
        devfleet.fault("retriever")
    rollout.refresh_from_db()
    assert rollout.reason.startswith("rolled back by itself after the switch: ")
    assert "requests failed in" in rollout.reason
    assert pipeline_and_retriever(weighted) == {frozenset({("rag_pipeline", 1), ("retriever", 1)})}


# Last: it leaves the pool on v8, which the `weighted` fixture does not expect to find.
def test_a_reindexed_retriever_is_evaluated_on_every_node_then_switched_everywhere(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    _, state = trio
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    with recording(balancer, rps=RPS) as recorder:
        wait_for("users' requests flow", lambda: recorder.sent)
        started = time.monotonic()
        rollout = start(weighted, canary=8, switch_hold_s=5)  # v1 with retriever 3
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        wait_for("switched and watched", lambda: current().state == State.SUCCEEDED, timeout=180)
        switched = time.monotonic()
        after_switch = served(state.nodes, state, "retriever")[3]
        wait_for(
            "the switch is answered",
            lambda: served(state.nodes, state, "retriever")[3] > after_switch,
        )
    # Users' requests went on at their rate through the whole release, and none failed.
    assert len(recorder.between(started, switched)) >= 0.9 * RPS * (switched - started)
    assert recorder.failed == 0
    # The pool's rollback window is 0 here: retriever 1 goes with the release before, once
    # the switch was watched.
    only_v8 = {frozenset({("rag_pipeline", 8), ("retriever", 3)})}
    wait_for("v1 let go", lambda: pipeline_and_retriever(weighted) == only_v8)
    runs = EvaluationRun.objects.filter(purpose=f"rollout #{rollout.pk}, before the switch")
    assert sorted((r.node.name, r.version, r.baseline_version, r.score) for r in runs) == [  # type: ignore[union-attr]
        (proc.name, 3, 1, 1.0) for proc in state.nodes
    ]
    found = Measurement.objects.get(rollout=rollout)
    assert (found.metric, found.verdict) == ("quality before the switch: retriever", "success")
    assert weights(haproxy) == equal(state)
