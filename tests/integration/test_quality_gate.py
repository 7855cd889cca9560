"""The quality gate on 3 real Triton nodes behind a real HAProxy: a release that is fast but
wrong never gets a user request; a healthy one passes and takes its share."""

import pytest

from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.quality.models import EvaluationRun, SyntheticLoad
from apps.quality.services import evaluation_set_import
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import rollout_abort
from tests.support.fleet import (
    ANALYSIS,
    HEALTHY,
    counted,
    equal,
    served,
    tick_until,
    traffic_to,
    wait_for,
    weights,
)
from tests.support.quality import DEMO_SET
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

State = Rollout.State
CANARY = "trio-1"  # the first node by name
FAQ = DEMO_SET.read_text()


def start(
    pool: NodePool, canary: int, plan: str = "33%, hold 10m\n100%", **analysis: object
) -> Rollout:
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=FAQ, actor="ci")
    return rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=canary,
        plan=plan,
        analysis={**ANALYSIS, **HEALTHY, "quality_set": "faq", **analysis},
        actor="release-manager",
    )


def test_a_fast_but_wrong_release_is_rolled_back_before_any_request_reaches_it(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState], celery: Celery
) -> None:
    _, state = trio
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    before = served(state.nodes, state, "reranker")
    with celery.holding_rollouts(), traffic_to(state, through=balancer, rps=20):
        rollout = start(weighted, canary=7)  # reranker v6: the worst passage first
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        tick_until("the gate's run starts", rollout, lambda: current().gate_run_id)
        assert weights(haproxy)[CANARY] == 0
        run = current().gate_run
        assert run is not None and (run.node.name, run.version, run.baseline_version) == (
            CANARY,
            7,
            1,
        )
        wait_for("the evaluation ran", lambda: EvaluationRun.objects.get(pk=run.pk).finished)
        # Between two ticks nothing else moves: Triton's own counter of the wrong reranker.
        cases = run.evaluation_set.cases.count()
        answered = counted(state.nodes, state, "reranker", 6, before[6] + cases)
        assert answered[6] - before[6] == cases == 30
        tick_until("rolled back", rollout, lambda: current().state == State.ROLLED_BACK)
    rollout.refresh_from_db()
    assert rollout.reason.startswith(
        "quality gate failed before any traffic: canary scored 0% (0 of 30 cases), below 90%; "
        "failing: orders-track-1, orders-track-2, orders-cancel-1,"
    )
    gate = Measurement.objects.get(rollout=rollout, metric="quality before traffic")
    assert (gate.verdict, gate.canary_value, gate.baseline_value) == ("failure", 0.0, 1.0)
    assert (gate.round.kind, gate.round.number, gate.round.verdict) == ("gate", 1, "failure")
    wait_for("equal shares again", lambda: weights(haproxy) == equal(state))


def test_a_healthy_release_passes_its_gate_and_is_evaluated_again_during_its_step(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    with traffic_to(trio[1], through=balancer, rps=8):
        rollout = start(weighted, canary=2, quality_every=1)
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        wait_for("the gate passed", lambda: current().gate_passed_at is not None, timeout=120)
        gate = Measurement.objects.get(rollout=rollout, metric="quality before traffic")
        assert (gate.verdict, gate.canary_value, gate.baseline_value) == ("success", 1.0, 1.0)
        assert current().step_ready_at == current().gate_passed_at  # judged from traffic on
        wait_for("the canary takes its share", lambda: (weights(haproxy) or {}).get(CANARY))
        during = Measurement.objects.filter(rollout=rollout, metric="quality (evaluation)")
        wait_for("the step's own evaluation is judged", during.exists, timeout=120)
        # Back to v1, as the next test's fixture expects the pool to be found.
        rollout_abort(rollout_id=rollout.pk, actor="release-manager")
        wait_for("rolled back", lambda: current().state == State.ROLLED_BACK, timeout=120)
    assert {m.verdict for m in during} == {"success"}
    # Those the rounds judged: one still running when the abort unloaded v2 lost its answers.
    runs = EvaluationRun.objects.filter(pk__in=[m.evidence["run"] for m in during])
    assert {(r.version, r.baseline_version, r.score, r.purpose) for r in runs} == {
        (2, 1, 1.0, f"rollout #{rollout.pk}, step 1")
    }


# Last: it leaves the pool on v2.
def test_a_quiet_canary_gets_the_requests_its_judge_needs_labelled_as_made(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    balancer = f"http://127.0.0.1:{haproxy.ports['http']}"
    # 10 % of 3 requests a second: about 3 in a 10 s window, where the judge needs 20.
    with traffic_to(trio[1], through=balancer, rps=3):
        rollout = start(
            weighted, canary=2, plan="10%, hold 20s\n100%", min_requests=20, synthetic_rps=4
        )
        current = lambda: Rollout.objects.get(pk=rollout.pk)  # noqa: E731
        wait_for("promoted", lambda: current().state == State.SUCCEEDED, timeout=240)
    rounds = Measurement.objects.filter(rollout=rollout, step=0, metric="requests")
    first = rounds.order_by("taken_at").first()
    assert first is not None and first.verdict == "inconclusive"
    assert "at least 20 each are needed" in first.detail
    made = rounds.filter(verdict="success").order_by("taken_at").first()
    assert made is not None and made.evidence["synthetic"]["nodes"] == [CANARY]
    assert "synthetic requests/s from rag_pipeline/faq v1 to trio-1" in made.detail
    load = SyntheticLoad.objects.get(pk=made.evidence["synthetic"]["load"])
    assert load.sent > 0 and load.failed == 0
    assert not AuditEvent.objects.filter(
        action="rollout.paused", target__startswith=f"rollout:{rollout.pk}:"
    )
