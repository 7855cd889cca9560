"""Rollout plans, checks and the state machine, with the fleet and Prometheus stubbed at their
boundaries: what nodes report (`observed_many`) and what analysis measures (`measure`). The
same paths run against real nodes and a real Prometheus in tests/integration/test_rollouts.py."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.accounts.roles import Role
from apps.accounts.services import token_create
from apps.audit.models import AuditEvent
from apps.fleet import selectors
from apps.fleet.models import Deployment, Node, NodePool, Release
from apps.fleet.owners import owner_let_go
from apps.fleet.services.deployments import deployment_set
from apps.fleet.traffic import balancer as balancing
from apps.fleet.traffic.balancer import Synced
from apps.performance.models import PerfRun
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.models import Model, ModelVersion
from apps.rollouts import analysis, rounds, transitions
from apps.rollouts.models import AnalysisTemplate, Measurement, Rollout
from apps.rollouts.plans import Analysis, PlanError, Step, parse_plan, preview
from apps.rollouts.proposals import rollout_propose, rollout_start
from apps.rollouts.results import Kind, Result
from apps.rollouts.selectors import last_good_version
from apps.rollouts.services import (
    RolloutError,
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_pause,
    rollout_promote,
    rollout_resume,
    rollout_retry,
    rollout_roll_back,
    template_save,
)
from apps.rollouts.tick import HANDLERS, TICK_ERROR_LIMIT, rollout_advance
from tests.support.audit import ROLLOUT_SERVICES, Case, assert_one_event_each
from tests.support.users import make_user

State = Rollout.State
PLAN = "1 node, hold 0s\n100%"
FAST = {"interval_s": 1, "window_s": 1, "warmup_s": 0, "failure_limit": 2, "error_limit": 2}


# Plans -------------------------------------------------------------------------------------------


def test_a_plan_reads_one_step_per_line() -> None:
    steps = parse_plan("1 node, hold 60s\n\n50%, hold 2m\n100%")
    assert steps == [Step(nodes=1, hold_s=60), Step(percent=50, hold_s=120), Step(percent=100)]
    assert parse_plan([{"nodes": 1, "hold": "60s"}, {"percent": 100, "hold_s": 5}]) == [
        Step(nodes=1, hold_s=60),
        Step(percent=100, hold_s=5),
    ]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("1 node\n50 hold 2m", "line 2: '50 hold 2m' is not a step"),
        ("0 nodes", "line 1: a step puts the canary on 1 node at least"),
        ("150%", "line 1: a share is between 1% and 100%"),
        ("", "a plan needs at least one step"),
        ([{"nodes": 1, "percent": 5}], "step 1: give either 'nodes' or 'percent'"),
        ([{"nodes": 1, "hold": "soon"}], "step 1: hold 'soon' is not a duration"),
    ],
)
def test_a_bad_plan_says_where(plan: Any, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(plan)


def test_bad_analysis_fields_are_named() -> None:
    with pytest.raises(PlanError, match=r"analysis\.window_s: 'x' is not a number"):
        Analysis.from_dict({"window_s": "x"})
    with pytest.raises(PlanError, match="unknown field 'p95'"):
        Analysis.from_dict({"p95": 1})
    assert Analysis.from_dict({"p99_tolerance": "0.5"}).p99_tolerance == 0.5


def test_shares_round_up_and_keep_the_same_nodes() -> None:
    nodes = ["c", "a", "b"]
    rows = preview(parse_plan("1 node\n50%\n100%"), nodes)
    assert [r.canary_nodes for r in rows] == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert [r.analysed for r in rows] == [True, True, False]


def test_the_active_states_match_the_database_constraint() -> None:
    (constraint,) = Rollout._meta.constraints
    assert sorted(dict(constraint.condition.children)["state__in"]) == sorted(Rollout.ACTIVE)  # type: ignore[attr-defined]


# A pool of three nodes running rag v1, and a simulated fleet -------------------------------------


@dataclass
class Fleet:
    """Stands in for the reconciler and Prometheus: nodes serve what they are told once
    `converge()` runs, and each analysis round returns `verdict`."""

    pool: NodePool
    served: dict[str, set[int]] = field(default_factory=dict)
    verdict: str = "success"
    requests: dict[str, float] = field(default_factory=dict)  # by node, in the last minute
    failing: set[str] = field(default_factory=set)  # models every round fails, whatever `verdict`

    def instant_query(self, query: str) -> list[tuple[dict[str, str], float]]:
        """Prometheus, as the rollout page's observed share asks it."""
        assert "nv_inference_request_success" in query
        return [({"node": node}, count) for node, count in self.requests.items()]

    def converge(self) -> None:
        pooled = Deployment.objects.filter(pool=self.pool).select_related("model")
        for node in self.pool.nodes.all():
            wanted = {d.model.name: d for d in pooled}
            wanted |= {d.model.name: d for d in node.deployments.select_related("model")}
            for model, deployment in wanted.items():
                baseline = {deployment.baseline_version} - {None}
                self.served[self.key(node.name, model)] = {deployment.version} | baseline

    @staticmethod
    def key(node: str, model: str) -> str:
        """gpu-1 for rag, the rollouts' model; gpu-1:embedder for any other."""
        return node if model == "rag" else f"{node}:{model}"

    def observed(
        self, nodes: list[Node], models: list[str]
    ) -> dict[tuple[int, str], tuple[set[int], datetime]]:
        return {
            (node.pk, model): (self.served.get(self.key(node.name, model), set()), timezone.now())
            for node in nodes
            for model in models
        }

    def measure(self, **kwargs: Any) -> list[Result]:
        if self.verdict == "error":
            raise PrometheusUnavailable("Prometheus at http://prom did not answer: stubbed.")
        verdict = "failure" if kwargs["model"] in self.failing else self.verdict
        values = {"success": 100.0, "failure": 900.0, "inconclusive": None}[verdict]
        return [
            Result("requests", "q1", 50, 50, 20, "success", "", kind=Kind.REQUESTS)
            if verdict != "inconclusive"
            else Result(
                "requests", "q1", 3, 50, 20, verdict, "canary served 3", kind=Kind.REQUESTS
            ),
            Result(
                "p99", "q2", values, 100.0, 120.0, verdict, f"{verdict} detail", kind=Kind.LATENCY
            ),
        ]


@pytest.fixture
def fleet(db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    model = Model.objects.create(name="rag", latency_budget_ms=500)
    for number in (1, 2, 3):
        ModelVersion.objects.create(
            model=model,
            version=number,
            config={"name": "rag", "backend": "python"},
            status=ModelVersion.Status.PUBLISHED,
        )
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    deployment_set(model_name="rag", version=1, pool=pool, actor="ops")
    simulated = Fleet(pool)
    simulated.converge()
    monkeypatch.setattr(selectors, "observed_many", simulated.observed)
    monkeypatch.setattr(rounds, "measure", simulated.measure)
    monkeypatch.setattr(analysis, "instant_query", simulated.instant_query)
    yield simulated


def start(
    canary: int = 2,
    plan: str = PLAN,
    template: str = "",
    lockstep: list[tuple[str, int]] | None = None,
    **analysis: Any,
) -> Rollout:
    return rollout_start(
        model_name="rag",
        pool_name="gpu",
        canary_version=canary,
        plan=plan,
        analysis={**FAST, **analysis} if not template else analysis,
        actor="release-manager",
        template=template,
        lockstep=lockstep,
    )


def tick(rollout: Rollout, *, later_s: float = 2) -> Rollout:
    """One controller tick, `later_s` seconds after the last one (the clock the controller reads
    is the database's timestamps: they move back instead of the test sleeping)."""
    earlier = timedelta(seconds=later_s)
    Rollout.objects.filter(pk=rollout.pk, last_measured_at__isnull=False).update(
        last_measured_at=F("last_measured_at") - earlier
    )
    Rollout.objects.filter(pk=rollout.pk, step_ready_at__isnull=False).update(
        step_ready_at=F("step_ready_at") - earlier
    )
    rollout_advance(rollout_id=rollout.pk)
    return Rollout.objects.get(pk=rollout.pk)


def test_a_good_canary_goes_step_by_step_to_the_whole_pool(fleet: Fleet) -> None:
    rollout = tick(start())
    assert (rollout.state, rollout.step, rollout.canary_nodes) == (State.PROGRESSING, 0, ["gpu-1"])
    assert Deployment.objects.get(node__name="gpu-1").baseline_version == 1  # beside, for rollback
    assert tick(rollout).step_ready_at is None  # gpu-1 is not serving v2 yet
    fleet.converge()
    rollout = tick(tick(rollout))  # ready; then measured and held: the next step goes out
    assert (rollout.step, rollout.canary_nodes) == (1, ["gpu-1", "gpu-2", "gpu-3"])
    fleet.converge()
    rollout = tick(tick(rollout))
    assert rollout.state == State.PROMOTING
    rollout = tick(rollout)
    assert Deployment.objects.get(pool__name="gpu").version == 2
    assert not Deployment.objects.filter(node__isnull=False).exists()
    fleet.served["gpu-3"] = {2}  # not yet what the pool's deployment asks
    assert tick(rollout).state == State.PROMOTING  # until every node is read back on it
    fleet.converge()
    rollout = tick(rollout)
    assert rollout.state == State.SUCCEEDED and rollout.finished_at
    # For the pool's rollback window, v1 stays loaded beside v2 (unversioned requests go to v2).
    assert fleet.served == {"gpu-1": {1, 2}, "gpu-2": {1, 2}, "gpu-3": {1, 2}}
    kept = Deployment.objects.get(pool__name="gpu")
    assert (kept.version, kept.baseline_version) == (2, 1)
    assert kept.baseline_until is not None
    window = (kept.baseline_until - timezone.now()).total_seconds()
    assert 890 < window <= 900


def test_the_release_before_is_not_kept_where_memory_does_not_allow(fleet: Fleet) -> None:
    from apps.fleet.services.nodes import node_set_memory

    ModelVersion.objects.filter(model__name="rag").update(memory_mb=400)
    # gpu-2 has room for one version, with headroom: v2 alone, not v1 beside it.
    node_set_memory(node_name="gpu-2", limit_mb=500, actor="sre")
    rollout = tick(start())
    for _ in range(6):  # converge, measure and hold each step, promote
        fleet.converge()
        rollout = tick(rollout)
    assert rollout.state == State.SUCCEEDED, rollout.state
    pooled = Deployment.objects.get(pool__name="gpu")
    assert (pooled.version, pooled.baseline_version, pooled.baseline_until) == (2, None, None)
    skipped = AuditEvent.objects.get(action="rollout.skip_window")
    assert skipped.message == (
        "the release before is not kept loaded for the rollback window, for want of memory"
        " beside the new one: gpu-2 needs 880 MiB with headroom for rag v1, rag v2;"
        " the node's 500 MiB limit has 500 MiB free"
    )


def test_the_rollback_window_closes_and_a_rollback_inside_it_only_narrows(fleet: Fleet) -> None:
    from apps.fleet.reconcile import rollback_windows_close

    rollout = tick(start())
    for _ in range(6):  # converge, measure and hold each step, promote
        fleet.converge()
        rollout = tick(rollout)
    assert rollout.state == State.SUCCEEDED, rollout.state
    assert release_rollback(model_name="rag", pool_name="gpu", actor="oncall") == 1
    pool = Deployment.objects.get(pool__name="gpu")
    assert (pool.version, pool.baseline_version, pool.baseline_until) == (1, None, None)
    fleet.converge()
    assert fleet.served["gpu-1"] == {1}  # v1 was there all along: the load only narrows
    deployment_set(
        model_name="rag",
        version=2,
        pool=fleet.pool,
        baseline=1,
        baseline_until=timezone.now() - timedelta(seconds=1),
        actor="ops",
    )
    assert rollback_windows_close() == 1 and rollback_windows_close() == 0
    pool = Deployment.objects.get(pool__name="gpu")
    assert (pool.version, pool.baseline_version, pool.baseline_until) == (2, None, None)
    closed = AuditEvent.objects.get(action="deployment.close_window")
    assert (closed.before, closed.after) == ({"version": 2, "baseline": 1}, {"version": 2})
    call_command("set_rollback_window", "gpu", "0")
    again = tick(start(canary=3))
    for _ in range(6):
        fleet.converge()
        again = tick(again)
    assert again.state == State.SUCCEEDED and fleet.served["gpu-1"] == {3}  # no window


def test_a_rollout_started_inside_a_rollback_window_rolls_back_to_both_releases(
    fleet: Fleet,
) -> None:
    deployment_set(
        model_name="rag",
        version=2,
        pool=fleet.pool,
        baseline=1,
        baseline_until=timezone.now() + timedelta(minutes=15),
        actor="ops",
    )
    fleet.converge()  # v2 served, v1 kept beside it for the window
    rollout = tick(start(canary=3))
    fleet.converge()
    rollout = tick(rollout)
    assert rollout.step_ready_at is not None and fleet.served["gpu-1"] == {2, 3}
    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    fleet.converge()
    assert fleet.served["gpu-1"] == {1, 2}  # the pool's deployment, window and all
    assert tick(rollout).state == State.ROLLED_BACK


def test_a_failing_canary_rolls_back_by_itself(fleet: Fleet) -> None:
    rollout = tick(start(canary=3))
    fleet.converge()
    rollout = tick(rollout)
    fleet.verdict = "failure"
    rollout = tick(rollout)
    assert (rollout.state, rollout.failures) == (State.PROGRESSING, 1)  # limit 2
    rollout = tick(rollout)
    assert rollout.state == State.ABORTING
    assert "p99: failure detail" in rollout.reason
    assert not Deployment.objects.filter(node__isnull=False).exists()
    fleet.converge()
    rollout = tick(rollout)
    assert rollout.state == State.ROLLED_BACK
    assert rollout.rollback_duration is not None
    assert fleet.served["gpu-1"] == {1}
    failing = rollout.measurements.filter(verdict="failure").first()
    assert failing and failing.canary_value == 900.0 and failing.threshold == 120.0


@pytest.fixture
def embedder(fleet: Fleet) -> Model:
    """A second model the pool runs (v1 of 1 and 2), to release in lockstep with rag."""
    model = Model.objects.create(name="embedder")
    for number in (1, 2):
        ModelVersion.objects.create(
            model=model,
            version=number,
            config={"name": "embedder", "backend": "python"},
            status=ModelVersion.Status.PUBLISHED,
        )
    deployment_set(model_name="embedder", version=1, pool=fleet.pool, actor="ops")
    fleet.converge()
    return model


def node_deployments() -> set[tuple[str, str, int, int | None]]:
    found = Deployment.objects.filter(node__isnull=False)
    return set(found.values_list("node__name", "model__name", "version", "baseline_version"))


def test_a_lockstep_release_goes_to_the_same_nodes_and_promotes_as_one(
    fleet: Fleet, embedder: Model
) -> None:
    rollout = start(lockstep=[("embedder", 2)])
    assert rollout.lockstep == [{"model": "embedder", "baseline": 1, "canary": 2}]
    assert str(rollout) == "rag v1 → v2 with embedder v1 → v2 on gpu"
    rollout = tick(rollout)
    assert node_deployments() == {("gpu-1", "rag", 2, 1), ("gpu-1", "embedder", 2, 1)}
    fleet.converge()
    fleet.served["gpu-1:embedder"] = {1}  # rag is READY there, the embedder not yet
    assert tick(rollout).step_ready_at is None
    fleet.converge()
    rollout = tick(tick(rollout))
    assert rollout.step == 1
    metrics = set(rollout.measurements.values_list("metric", flat=True))
    assert metrics == {"requests", "p99", "embedder: requests", "embedder: p99"}
    fleet.converge()
    rollout = tick(tick(tick(rollout)))  # measured, held; promoting
    pooled = Deployment.objects.filter(pool=fleet.pool)
    assert set(pooled.values_list("model__name", "version", "baseline_version")) == {
        ("rag", 2, 1),  # each with its baseline kept for the rollback window
        ("embedder", 2, 1),
    }
    fleet.served["gpu-2:embedder"] = {2}
    assert not node_deployments() and tick(rollout).state == State.PROMOTING
    fleet.converge()
    assert tick(rollout).state == State.SUCCEEDED


def test_one_failing_lockstep_model_rolls_back_both(fleet: Fleet, embedder: Model) -> None:
    rollout = tick(start(lockstep=[("embedder", 2)], failure_limit=1))
    fleet.converge()
    fleet.failing = {"embedder"}  # rag itself passes every round
    rollout = tick(tick(rollout))
    assert rollout.state == State.ABORTING
    assert rollout.reason == "failure: embedder: p99: failure detail"
    assert not node_deployments()
    fleet.converge()
    rollout = tick(rollout)
    assert rollout.state == State.ROLLED_BACK
    assert fleet.served["gpu-1"] == {1} and fleet.served["gpu-1:embedder"] == {1}
    events = AuditEvent.objects.filter(target__startswith="rollout:").order_by("id")
    assert {e.target for e in events} == {f"rollout:{rollout.pk}:rag"}  # one release


def test_a_lockstep_start_checks_every_model(fleet: Fleet, embedder: Model) -> None:
    with pytest.raises(RolloutError, match="no model 'nope' in the registry"):
        start(lockstep=[("nope", 1)])
    with pytest.raises(RolloutError, match="embedder v7 is not in the registry"):
        start(lockstep=[("embedder", 7)])
    with pytest.raises(RolloutError, match="pool gpu already runs embedder v1"):
        start(lockstep=[("embedder", 1)])
    with pytest.raises(RolloutError, match="rag is released twice in one rollout"):
        start(lockstep=[("rag", 3)])
    running = start(lockstep=[("embedder", 2)])
    with pytest.raises(RolloutError, match=f"rollout #{running.pk} of rag v1 → v2 with embedder"):
        rollout_start(
            model_name="embedder",
            pool_name="gpu",
            canary_version=2,
            plan=PLAN,
            analysis=FAST,
            actor="release-manager",
        )
    rollout_abort(rollout_id=running.pk, actor="release-manager")
    assert set(
        Deployment.objects.filter(pool=fleet.pool).values_list("model__name", "version")
    ) == {
        ("rag", 1),
        ("embedder", 1),
    }


def test_prometheus_errors_past_the_limit_roll_back(fleet: Fleet) -> None:
    rollout = tick(start())
    fleet.converge()
    fleet.verdict = "error"
    rollout = tick(tick(rollout))
    assert (rollout.state, rollout.errors) == (State.PROGRESSING, 1)
    rollout = tick(rollout)
    assert rollout.state == State.ABORTING
    assert rollout.reason.startswith("error: Prometheus failed 2 times in a row")


def test_too_little_data_pauses_and_says_why(fleet: Fleet) -> None:
    rollout = tick(start())
    fleet.converge()
    fleet.verdict = "inconclusive"
    rollout = tick(tick(rollout))
    assert rollout.state == State.PAUSED
    assert rollout.reason == "inconclusive: canary served 3; inconclusive detail"  # as measured
    fleet.verdict = "success"
    rollout = tick(rollout_resume(rollout_id=rollout.pk, actor="ops"))
    assert (rollout.state, rollout.step) == (State.PROGRESSING, 1)


def test_a_node_down_mid_step_pauses(fleet: Fleet) -> None:
    rollout = tick(start())
    Node.objects.filter(name="gpu-3").update(health=Node.Health.UNREACHABLE)
    rollout = tick(rollout)
    assert rollout.state == State.PAUSED and "gpu-3 is unreachable" in rollout.reason


def test_start_refuses_what_cannot_roll_out(fleet: Fleet) -> None:
    with pytest.raises(RolloutError, match="already runs rag v1"):
        start(canary=1)
    with pytest.raises(RolloutError, match="rag v9 is not in the registry"):
        start(canary=9)
    ModelVersion.objects.filter(version=3).update(status=ModelVersion.Status.DRAFT)
    with pytest.raises(RolloutError, match="rag v3 is draft, not published"):
        start(canary=3)
    with pytest.raises(PlanError, match="step 2: 1 canary nodes after 2"):
        start(plan="2 nodes\n1 node")
    rollout = start()
    with pytest.raises(
        RolloutError, match=f"rollout #{rollout.pk} of rag v1 → v2 on gpu is pending"
    ):
        start()
    NodePool.objects.create(name="empty")
    with pytest.raises(RolloutError, match="pool empty has no nodes"):
        rollout_start(
            model_name="rag", pool_name="empty", canary_version=2, plan=PLAN, analysis={}, actor="x"
        )


def test_the_database_allows_one_active_rollout_per_model_and_pool(fleet: Fleet) -> None:
    first = start()
    with pytest.raises(IntegrityError), transaction.atomic():
        Rollout.objects.create(
            model=first.model, pool=first.pool, baseline_version=1, canary_version=3, plan=[]
        )
    transitions.transition(first, State.ROLLED_BACK)  # its end lets the pool go, too
    assert start(canary=3).active


def test_human_actions_are_audited_and_respect_the_state(fleet: Fleet) -> None:
    rollout = tick(start())
    rollout_pause(rollout_id=rollout.pk, actor="ops")
    with pytest.raises(RolloutError, match="is paused: cannot pause it"):
        rollout_pause(rollout_id=rollout.pk, actor="ops")
    with pytest.raises(RolloutError, match="a reason is required"):
        rollout_promote(rollout_id=rollout.pk, reason=" ", actor="ops")
    rollout_promote(rollout_id=rollout.pk, reason="hotfix", actor="ops")
    rollout = rollout_abort(rollout_id=rollout.pk, actor="ops", reason="changed my mind")
    assert rollout.reason == "aborted by ops: changed my mind"
    assert Deployment.objects.get(pool__name="gpu").version == 1
    actions = list(
        AuditEvent.objects.filter(target__startswith="rollout:", actor="ops").values_list(
            "action", "result"
        )
    )
    assert actions == [
        ("rollout.aborting", "ok"),
        ("rollout.promoting", "ok"),
        ("rollout.promote", "failed"),  # no reason given
        ("rollout.pause", "failed"),  # already paused
        ("rollout.paused", "ok"),
    ]


def test_retry_starts_a_new_rollout_and_the_old_one_stays_terminal(fleet: Fleet) -> None:
    rollout = tick(start())
    rollout_abort(rollout_id=rollout.pk, actor="ops")
    fleet.converge()
    rollout = tick(rollout)
    assert rollout.state == State.ROLLED_BACK
    again = rollout_retry(rollout_id=rollout.pk, actor="ops")
    assert again.pk != rollout.pk and again.state == State.PENDING
    assert Rollout.objects.get(pk=rollout.pk).state == State.ROLLED_BACK


def test_rollback_and_fallback_switch_the_pool_at_once(fleet: Fleet) -> None:
    deployment_set(model_name="rag", version=2, pool=fleet.pool, actor="ops")
    assert last_good_version(fleet.pool.deployments.get().model, fleet.pool) == 1
    rollout = tick(start(canary=3))
    assert release_rollback(model_name="rag", pool_name="gpu", actor="oncall") == 1
    assert last_good_version(Model.objects.get(name="rag"), fleet.pool) is None  # not v2 again
    assert Rollout.objects.get(pk=rollout.pk).state == State.ABORTING
    assert Deployment.objects.get(pool__name="gpu").version == 1
    assert not Deployment.objects.filter(node__isnull=False).exists()
    with pytest.raises(RolloutError, match="rag has no fallback version"):
        release_fallback(model_name="rag", pool_name="gpu", actor="oncall")
    Model.objects.filter(name="rag").update(fallback_version=3)
    assert release_fallback(model_name="rag", pool_name="gpu", actor="oncall") == 3
    assert AuditEvent.objects.filter(action="release.fallback", result="failed").count() == 1


def test_release_history_is_its_own_table_and_last_good_reads_only_it(fleet: Fleet) -> None:
    deployment_set(model_name="rag", version=2, pool=fleet.pool, actor="ops")
    deployment_set(model_name="rag", version=3, pool=fleet.pool, actor="ann")
    history = list(Release.objects.filter(pool=fleet.pool).order_by("started_at", "id"))
    assert [(r.version, r.started_by, r.ended_at is None) for r in history] == [
        (1, "ops", False),
        (2, "ops", False),
        (3, "ann", True),
    ]
    assert history[0].ended_at == history[1].started_at
    rag = Model.objects.get(name="rag")
    with CaptureQueriesContext(connection) as captured:
        assert last_good_version(rag, fleet.pool) == 2
    assert not [q for q in captured.captured_queries if "audit" in q["sql"]]
    assert release_rollback(model_name="rag", pool_name="gpu", actor="oncall") == 2
    assert Release.objects.get(version=3).rolled_back
    assert last_good_version(Model.objects.get(name="rag"), fleet.pool) == 1  # never v3 again


def test_every_rollout_service_records_one_event_refused_or_done(fleet: Fleet) -> None:
    """One event per action, a composite one included: a rollback's deployment changes and the
    rollout it aborts are parts of its event."""
    deployment_set(model_name="rag", version=2, pool=fleet.pool, actor="ops")
    made: dict[str, Rollout] = {}
    rollout = lambda: made["rollout"].pk  # noqa: E731

    def fallback() -> int:
        Model.objects.filter(name="rag").update(fallback_version=3)  # no event of its own
        return release_fallback(model_name="rag", pool_name="gpu", actor="oncall")

    def retried() -> Rollout:
        ended = Rollout.objects.select_related("model", "pool").get(pk=rollout())
        Rollout.objects.filter(pk=ended.pk).update(state=State.ROLLED_BACK)
        owner_let_go(pool=ended.pool, model=ended.model, ref=transitions.owner_ref(ended))
        return made.setdefault("retried", rollout_retry(rollout_id=rollout(), actor="ops"))

    cases = [
        Case(
            release_rollback,
            "release.rollback",
            lambda: release_rollback(model_name="rag", pool_name="nowhere", actor="oncall"),
            lambda: release_rollback(model_name="rag", pool_name="gpu", actor="oncall"),
        ),
        Case(
            release_fallback,
            "release.fallback",
            lambda: release_fallback(model_name="rag", pool_name="gpu", actor="oncall"),
            fallback,
        ),
        Case(
            rollout_start,
            "rollout.start",
            lambda: start(canary=99),
            lambda: made.setdefault("rollout", start(canary=2)),
        ),
        Case(
            rollout_pause,
            "rollout.pause",
            lambda: rollout_pause(rollout_id=0, actor="ops"),
            lambda: rollout_pause(rollout_id=rollout(), actor="ops"),
            done="rollout.paused",
        ),
        Case(
            rollout_resume,
            "rollout.resume",
            lambda: rollout_resume(rollout_id=0, actor="ops"),
            lambda: rollout_resume(rollout_id=rollout(), actor="ops"),
            done="rollout.resume",
        ),
        Case(
            rollout_promote,
            "rollout.promote",
            lambda: rollout_promote(rollout_id=rollout(), reason=" ", actor="ops"),
            lambda: rollout_promote(rollout_id=rollout(), reason="hotfix", actor="ops"),
            done="rollout.promoting",
        ),
        Case(
            rollout_abort,
            "rollout.abort",
            lambda: rollout_abort(rollout_id=0, actor="ops"),
            lambda: rollout_abort(rollout_id=rollout(), actor="ops"),
            done="rollout.aborting",
        ),
        Case(
            rollout_retry,
            "rollout.retry",
            lambda: rollout_retry(rollout_id=rollout(), actor="ops"),  # still aborting
            retried,
        ),
        Case(
            rollout_roll_back,
            "rollout.roll_back",
            lambda: rollout_roll_back(rollout_id=0, actor="oncall", reason="incident #1"),
            lambda: rollout_roll_back(
                rollout_id=made["retried"].pk, actor="oncall", reason="incident #1"
            ),
            done="rollout.aborting",
        ),
        Case(
            template_save,
            "analysis_template.save",
            lambda: template_save(name="t", analysis={"judge": "?"}, actor="ops"),
            lambda: template_save(name="t", analysis={"judge": "statistical"}, actor="ops"),
        ),
    ]
    assert {case.service for case in cases} == ROLLOUT_SERVICES
    assert_one_event_each(cases)
    rollback = AuditEvent.objects.get(action="release.rollback", result="ok")
    assert (rollback.before, rollback.outcome) == ({"version": 2}, {"version": 1})
    assert [part["action"] for part in rollback.parts] == ["deployment.set"]
    retry = AuditEvent.objects.get(action="rollout.retry", result="ok")
    assert [part["action"] for part in retry.parts] == ["rollout.start"]


def test_a_tick_that_keeps_failing_is_shown_and_pauses_the_rollout(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, client: Client, viewer: User
) -> None:
    rollout = start()

    def bug(rollout: Rollout, reading: rounds.Measured | None) -> None:
        raise KeyError("plan")

    with monkeypatch.context() as patched:
        patched.setitem(HANDLERS, State.PENDING, bug)
        for _ in range(TICK_ERROR_LIMIT):
            with pytest.raises(KeyError):
                rollout_advance(rollout_id=rollout.pk)
    rollout.refresh_from_db()
    assert (rollout.state, rollout.tick_errors) == (State.PAUSED, 3)
    assert "the controller failed 3 ticks in a row (KeyError: 'plan')" in rollout.reason
    client.force_login(viewer)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert 'id="tick-error"' in page and "failed 3 ticks in a row: KeyError" in page
    rollout_resume(rollout_id=rollout.pk, actor="ops")
    rollout = tick(rollout)
    assert (rollout.tick_errors, rollout.tick_error) == (0, "")  # a good tick clears it


# Any sequence of actions, verdicts and crashes -----------------------------------------------------

# Ticks are most of what happens; before each step the fleet may or may not have converged.
ACTIONS = st.sampled_from(
    ["tick"] * 12 + ["start", "pause", "resume", "promote", "abort", "retry", "rollback", "crash"]
)
VERDICTS = st.sampled_from(["success", "failure", "inconclusive", "error"])
HUMAN = {
    "pause": rollout_pause,
    "resume": rollout_resume,
    "abort": rollout_abort,
    "promote": lambda **kwargs: rollout_promote(reason="test", **kwargs),
}


class Crash(BaseException):
    """A worker killed mid-tick: like SIGKILL, nothing in the process gets to handle it."""


def _crash(*args: object) -> None:
    raise Crash


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.tuples(ACTIONS, VERDICTS, st.integers(2, 3), st.booleans()), max_size=40))
def test_any_sequence_keeps_the_invariants(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, script: list[tuple[str, str, int, bool]]
) -> None:
    Rollout.objects.all().delete()
    Deployment.objects.filter(node__isnull=False).delete()
    Deployment.objects.filter(pool=fleet.pool).update(version=1)
    fleet.converge()
    terminal: dict[int, str] = {}
    for action, verdict, canary, converged in script:
        fleet.verdict = verdict
        if converged:
            fleet.converge()
        active = Rollout.objects.filter(state__in=Rollout.ACTIVE).first()
        latest = Rollout.objects.first()
        try:
            with transaction.atomic():
                if action == "start":
                    start(canary=canary)
                elif action == "rollback":
                    release_rollback(model_name="rag", pool_name="gpu", actor="x")
                elif action == "retry" and latest:
                    rollout_retry(rollout_id=latest.pk, actor="x")
                elif active and action == "tick":
                    tick(active)
                elif active and action == "crash":  # the worker dies in the middle of a tick
                    with monkeypatch.context() as patched:
                        patched.setattr(transitions, "notify", _crash)
                        tick(active)
                elif active and action in HUMAN:
                    HUMAN[action](rollout_id=active.pk, actor="x")
        except (RolloutError, PlanError, Crash):
            pass
        rollouts = list(Rollout.objects.all())
        assert sum(r.active for r in rollouts) <= 1
        for r in rollouts:
            if r.pk in terminal:
                assert r.state == terminal[r.pk], f"#{r.pk} left {terminal[r.pk]}"
            elif r.state in Rollout.TERMINAL:
                terminal[r.pk] = r.state
        if active and active.state == State.PROGRESSING and action == "tick":
            # Every tick measures (the interval has passed) and moves on only if that measurement
            # passed: never on failure, error or too little data.
            after = Rollout.objects.get(pk=active.pk)
            if after.step > active.step or after.state == State.PROMOTING:
                assert verdict == "success", f"moved on after {verdict}"


# Analysis arithmetic, Prometheus stubbed at its module boundary ---------------------------------


def test_analysis_splits_by_node_and_compares_changed_steps_by_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from apps.rollouts import analysis

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        if "nv_inference_request_success" in query and "duration" not in query:
            return [({"node": n}, 40.0) for n in ("a", "b", "c")]
        if "nv_inference_request_failure" in query:
            return [({"node": "a"}, 4.0)]  # only the canary fails, 10% of its requests
        if "summary" in query:
            return [({"node": "a"}, 300.0), ({"node": "b"}, 100.0), ({"node": "c"}, 120.0)]
        if "kv_cache" in query:
            return []  # no LLM: no KV cache exported
        assert 'model="reranker"' in query  # mean latency of the changed step, per version
        return [({"version": "3"}, 260.0), ({"version": "1"}, 20.0)]

    monkeypatch.setattr(analysis, "instant_query", answer)
    results = analysis.measure(
        model="rag",
        pool="gpu",
        canary_nodes=["a"],
        spec=Analysis(judge="threshold", p99_tolerance=0.5, error_delta=0.01, min_requests=20),
        budget_ms=250,
        steps=[analysis.ChangedStep("reranker", 3, 1, None)],
    )
    found = {r.metric: r for r in results}
    assert (found["requests"].canary, found["requests"].baseline) == (44.0, 80.0)
    assert (found["p99"].canary, found["p99"].baseline, found["p99"].threshold) == (
        300.0,
        120.0,
        180.0,  # 120 x 1.5, under the 250 ms budget
    )
    assert found["error_ratio"].canary == pytest.approx(4 / 44)
    assert found["error_ratio"].verdict == "failure"
    step = found["mean latency reranker v3 vs v1"]
    assert (step.canary, step.baseline, step.threshold, step.verdict) == (260, 20, 30, "failure")
    assert analysis.overall(results) == "failure"
    assert 'node=~"a"' in found["p99"].query


def test_with_the_canary_everywhere_only_the_budget_judges(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.rollouts import analysis

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        if "summary" in query:
            return [({"node": "a"}, 90.0), ({"node": "b"}, 95.0)]
        return [({"node": n}, 30.0) for n in ("a", "b")] if "success" in query else []

    monkeypatch.setattr(analysis, "instant_query", answer)
    results = analysis.measure(
        model="rag",
        pool="gpu",
        canary_nodes=["a", "b"],
        spec=Analysis(judge="threshold", min_requests=20),
        budget_ms=None,
        steps=[],
        compare=False,
    )
    assert [r.verdict for r in results] == ["success", "success", "success"]
    assert results[1].detail == "no baseline left to compare with, and no budget"
    assert results[2].threshold == Analysis().error_delta


def test_the_statistical_judge_compares_each_nodes_samples_and_keeps_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from apps.prometheus.client import Series
    from apps.rollouts import analysis

    def counts(query: str) -> list[tuple[dict[str, str], float]]:
        if "summary" in query or "failure" in query or "kv_cache" in query:
            return []
        return [({"node": n}, 40.0) for n in ("a", "b", "c")]

    latency = {"a": [210.0, 190, 205, 200], "b": [100.0, 98, 103, 99], "c": [101.0, 97, 102, 100]}
    asked: list[tuple[str, int]] = []

    def samples(query: str, *, start: object, end: object, step_s: int) -> list[Series]:
        asked.append((query, step_s))
        if "vllm:" in query:  # rag is no LLM: no backend exports an LLM's series of it
            return []
        if "duration" in query:
            return [Series({"node": n}, [], list(v)) for n, v in latency.items()]
        return [Series({"node": n}, [], [0.0, None, 0.0, 0.0]) for n in latency]

    monkeypatch.setattr(analysis, "instant_query", counts)
    monkeypatch.setattr(analysis, "range_query", samples)
    spec = Analysis(judge="statistical", sample_s=5, window_s=20, min_requests=20)
    results = analysis.measure(
        model="rag", pool="gpu", canary_nodes=["a"], spec=spec, budget_ms=None, steps=[]
    )
    found = {r.metric: r for r in results}
    assert set(found) == {"requests", "latency (samples)", "error_ratio (samples)"}
    slow = found["latency (samples)"]
    assert (slow.verdict, slow.canary, slow.baseline) == ("failure", 202.5, 100.0)
    assert slow.evidence["canary"] == latency["a"] and len(slow.evidence["baseline"]) == 8
    assert slow.detail == "canary +102.5% against the baseline (tolerance 0.1, margin 5), p=0.00418"
    assert found["error_ratio (samples)"].verdict == "success"
    assert found["error_ratio (samples)"].evidence["canary"] == [0.0, 0.0, 0.0]  # a gap is none
    assert [step for _, step in asked] == [5] * 5  # latency, errors, and three an LLM's
    assert analysis.overall(results, spec.pass_score) == "failure"
    latency["a"] = [x * 1.05 for x in latency["b"]]  # 5 % slower on every sample: within tolerance
    results = analysis.measure(
        model="rag", pool="gpu", canary_nodes=["a"], spec=spec, budget_ms=None, steps=[]
    )
    assert [r.verdict for r in results] == ["success", "marginal", "success"]
    assert analysis.overall(results, spec.pass_score) == "marginal"


def generator_judged(
    monkeypatch: pytest.MonkeyPatch, samples: Callable[..., list[Any]]
) -> tuple[Analysis, list[Result]]:
    """The statistical judge on "generator" in pool gpu, canary node "a" of a, b and c, each
    with 40 requests and none failed (no P99 summary, no KV cache exported), its samples as
    `samples` answers."""

    def counts(query: str) -> list[tuple[dict[str, str], float]]:
        served = all(word not in query for word in ("summary", "failure", "kv_cache"))
        return [({"node": n}, 40.0) for n in ("a", "b", "c")] if served else []

    monkeypatch.setattr(analysis, "instant_query", counts)
    monkeypatch.setattr(analysis, "range_query", samples)
    spec = Analysis(judge="statistical", sample_s=5, window_s=20, min_requests=20)
    results = analysis.measure(
        model="generator", pool="gpu", canary_nodes=["a"], spec=spec, budget_ms=None, steps=[]
    )
    return spec, results


@pytest.mark.parametrize(
    ("canary", "failed"),
    [
        ({}, None),
        ({"time to first token": 2.0}, "time to first token (samples)"),
        ({"output tokens per request": 2.0}, "output tokens per request (samples)"),
        ({"time per output token": 1.5}, "time per output token (samples)"),
    ],
)
def test_an_llm_canary_is_judged_on_its_first_token_its_tokens_and_its_answers_length(
    monkeypatch: pytest.MonkeyPatch, canary: dict[str, float], failed: str | None
) -> None:
    """Each node's samples, whatever backend: the canary node "a" is `canary` times the
    baseline's on each named sample (the same whole-request latency)."""
    from apps.prometheus import llm
    from apps.prometheus.client import Series

    baseline = {"time to first token": 300.0, "time per output token": 20.0}
    baseline |= {"output tokens per request": 100.0, "latency": 2300.0, "error_ratio": 0.0}
    queries = analysis.llm_sample_queries(model="generator", pool="gpu", step_s=5)
    queries |= analysis.sample_queries(model="generator", pool="gpu", step_s=5)
    by_query = {query: name for name, query in queries.items()}
    assert llm.SERIES[llm.TTFT][1].series in queries["time to first token"]  # vLLM's as well

    def samples(query: str, *, start: object, end: object, step_s: int) -> list[Series]:
        if query not in by_query:  # the prompts' length: not exported here
            return []
        name = by_query[query]
        value = baseline[name]
        return [
            Series({"node": n}, [], [value * (canary.get(name, 1) if n == "a" else 1) + i % 2])
            for n in ("a", "b", "c")
            for i in range(4)
        ]

    spec, results = generator_judged(monkeypatch, samples)
    verdicts = {r.metric: r.verdict for r in results}
    kinds = {r.metric: r.kind for r in results}
    assert kinds["time to first token (samples)"] == "ttft"
    assert kinds["output tokens per request (samples)"] == "tokens"
    assert [m for m, v in verdicts.items() if v == "failure"] == ([failed] if failed else [])
    assert analysis.overall(results, spec.pass_score) == ("failure" if failed else "success")


def test_an_llm_canary_that_got_longer_prompts_is_judged_within_prompt_length_buckets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every node answers its first token in 100 ms plus 1 ms a prompt token; canary node "a"
    happened to get long prompts three samples in four, the others one in four: together it
    reads twice as slow, bucket by bucket it is as fast."""
    from apps.prometheus.client import Series

    times = [0.0, 5.0, 10.0, 15.0]
    prompts = {"a": [200, 200, 200, 40], "b": [40, 40, 200, 40], "c": [40, 40, 40, 200]}

    def samples(query: str, *, start: object, end: object, step_s: int) -> list[Series]:
        def each(value: Callable[[int], float]) -> list[Series]:
            return [Series({"node": n}, times, [value(p) for p in ps]) for n, ps in prompts.items()]

        if "prompt_tokens" in query:
            return each(float)
        if "time_to_first_token" in query:
            return each(lambda prompt: 100.0 + prompt)
        if "duration" in query:  # whole requests alike
            return each(lambda _: 900.0)
        if "failure" in query:
            return each(lambda _: 0.0)
        return []  # no time per token nor tokens exported here

    _, results = generator_judged(monkeypatch, samples)
    found = {r.metric: r for r in results}["time to first token (samples)"]
    assert found.verdict == "success", found.detail
    assert "within buckets of the prompt's length" in found.query
    assert "vllm:prompt_tokens_total" in found.query


@pytest.mark.parametrize(
    ("used", "verdict"),
    [
        ({"a": 0.97, "b": 0.40, "c": 0.50}, "failure"),
        ({"a": 0.60, "b": 0.40, "c": 0.50}, "success"),
        ({"a": 0.97, "b": 0.96, "c": 0.50}, "inconclusive"),  # the pool is full, not the release
    ],
)
def test_an_llm_canary_whose_kv_cache_is_full_fails_unless_the_baseline_is_as_full(
    monkeypatch: pytest.MonkeyPatch, used: dict[str, float], verdict: str
) -> None:
    """TensorRT-LLM's blocks in use over all of them, per node: canary node "a"."""

    def counts(query: str) -> list[tuple[dict[str, str], float]]:
        if "kv_cache" in query:
            return [({"node": n}, share) for n, share in used.items()]
        served = "summary" not in query and "failure" not in query
        return [({"node": n}, 40.0) for n in ("a", "b", "c")] if served else []

    monkeypatch.setattr(analysis, "instant_query", counts)
    spec = Analysis(judge="threshold", min_requests=20)
    results = analysis.measure(
        model="trtllm", pool="gpu", canary_nodes=["a"], spec=spec, budget_ms=None, steps=[]
    )
    [guard] = [r for r in results if r.kind == "kv_cache"]
    assert (guard.canary, guard.baseline, guard.threshold) == (
        used["a"],
        max(used["b"], used["c"]),
        0.95,
    )
    assert guard.verdict == verdict
    assert 'kv_cache_block_type="used"' in guard.query and 'model="trtllm"' in guard.query


# Pages and permissions -----------------------------------------------------------------------------


@pytest.fixture
def release_manager(db: None) -> User:
    return make_user(Role.RELEASE_MANAGER)


FORM = {
    "model": "rag",
    "pool": "gpu",
    "canary_version": "2",
    "plan": "1 node, hold 30s\n100%",
    "interval_s": "10",
    "window_s": "60",
    "warmup_s": "30",
    "p99_tolerance": "0.2",
    "p99_margin_ms": "10",
    "error_delta": "0.01",
    "min_requests": "20",
    "failure_limit": "2",
}


def test_the_form_previews_then_starts(fleet: Fleet, client: Client, release_manager: User) -> None:
    client.force_login(release_manager)
    preview = client.post("/rollouts/new/", {**FORM, "preview": ""}).content.decode()
    assert "Dry run: rag v1 → v2 on gpu" in preview
    assert "<td>gpu-1</td><td>gpu-2, gpu-3</td>" in preview
    assert not Rollout.objects.exists()
    bad = client.post("/rollouts/new/", {**FORM, "plan": "1 node\nhalf", "preview": ""})
    assert "line 2: &#x27;half&#x27; is not a step" in bad.content.decode()
    started = client.post("/rollouts/new/", {**FORM, "start": ""})
    rollout = Rollout.objects.get()
    assert started["Location"] == f"/rollouts/{rollout.pk}/"
    assert rollout.analysis["window_s"] == 60 and rollout.plan[0] == {"nodes": 1, "hold_s": 30}


def test_the_form_and_the_api_start_a_lockstep_release(
    fleet: Fleet, embedder: Model, client: Client, release_manager: User
) -> None:
    client.force_login(release_manager)
    bad = client.post("/rollouts/new/", {**FORM, "lockstep": "embedder", "preview": ""})
    assert "&#x27;embedder&#x27; is not MODEL:VERSION" in bad.content.decode()
    preview = client.post("/rollouts/new/", {**FORM, "lockstep": "embedder:2", "preview": ""})
    assert "<strong>embedder</strong> v1 → v2" in preview.content.decode()
    client.post("/rollouts/new/", {**FORM, "lockstep": " embedder : 2 ", "start": ""})
    rollout = Rollout.objects.get()
    assert rollout.lockstep == [{"model": "embedder", "baseline": 1, "canary": 2}]
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "judged and rolled back together: <strong>embedder</strong> v1 → v2" in page
    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    fleet.converge()
    assert tick(rollout).state == State.ROLLED_BACK
    _, token = token_create(user=release_manager, name="ci", actor="system:test")
    body = {"model": "rag", "pool": "gpu", "canary_version": 2, "plan": PLAN}
    body["lockstep"] = [{"model": "embedder", "canary_version": 2}]
    auth = {"Authorization": f"Bearer {token}"}
    started = client.post("/api/rollouts", body, content_type="application/json", headers=auth)
    assert started.status_code == 201, started.content
    assert started.json()["lockstep"] == [{"model": "embedder", "baseline": 1, "canary": 2}]
    body["lockstep"] = [{"model": "nope", "canary_version": 2}]
    refused = client.post("/api/rollouts", body, content_type="application/json", headers=auth)
    assert refused.status_code == 409
    assert "no model 'nope'" in refused.json()["error"]["message"]


def test_the_preview_warns_where_the_canary_would_not_fit_in_memory(
    fleet: Fleet, client: Client, release_manager: User
) -> None:
    ModelVersion.objects.filter(model__name="rag", version=2).update(memory_mb=200)
    assert (
        rollout_propose(model_name="rag", pool_name="gpu", canary_version=2, plan=PLAN).memory == []
    )
    Node.objects.filter(name="gpu-2").update(memory_limit_mb=100)
    proposal = rollout_propose(model_name="rag", pool_name="gpu", canary_version=2, plan=PLAN)
    assert proposal.memory == [
        "gpu-2 needs 220 MiB with headroom for rag v2; the node's 100 MiB limit has 100 MiB free"
    ]
    client.force_login(release_manager)
    preview = client.post("/rollouts/new/", {**FORM, "preview": ""}).content.decode()
    assert "Will not fit in memory" in preview and "<li>gpu-2 needs 220 MiB" in preview


def test_a_percent_step_states_its_real_share_and_more_than_twice_it_needs_consent(
    fleet: Fleet, client: Client, release_manager: User
) -> None:
    """5% of a 3-node pool is one node: a third of the requests, which used to pass silently."""
    plan = "5%, hold 60s\n100%"
    with pytest.raises(
        PlanError, match=r"step 1: 5% of pool gpu is 33% of requests, on 1 of 3 nodes"
    ):
        rollout_propose(model_name="rag", pool_name="gpu", canary_version=2, plan=plan)
    proposal = rollout_propose(
        model_name="rag", pool_name="gpu", canary_version=2, plan=plan, accept_shares=True
    )
    assert [(row.real_percent, row.overshoots) for row in proposal.preview] == [
        (33, True),
        (100, False),
    ]
    fair = rollout_propose(model_name="rag", pool_name="gpu", canary_version=2, plan="50%\n100%")
    assert not fair.preview[0].overshoots  # 2 of 3 nodes, 67%: not twice the 50% asked
    client.force_login(release_manager)
    refused = client.post("/rollouts/new/", {**FORM, "plan": plan, "start": ""})
    assert "accept the real shares to go on" in refused.content.decode()
    assert not Rollout.objects.exists()
    shown = client.post(
        "/rollouts/new/", {**FORM, "plan": plan, "accept_shares": "on", "preview": ""}
    ).content.decode()
    assert "really 33% of requests, on 1 of 3 nodes" in shown
    client.post("/rollouts/new/", {**FORM, "plan": plan, "accept_shares": "on", "start": ""})
    rollout = Rollout.objects.get()
    assert rollout.plan[0] == {"percent": 5, "hold_s": 60}
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert '5% <span class="small error">(really 33% of requests, on 1 of 3 nodes)</span>' in page


def test_the_live_part_stops_polling_once_terminal(
    fleet: Fleet, client: Client, viewer: User
) -> None:
    rollout = tick(start())
    client.force_login(viewer)
    live = {"HX-Request": "true", "HX-Target": "rollout-live"}
    assert client.get(f"/rollouts/{rollout.pk}/", headers=live).status_code == 200
    Rollout.objects.filter(pk=rollout.pk).update(state=State.ROLLED_BACK)
    response = client.get(f"/rollouts/{rollout.pk}/", headers=live)
    assert response.status_code == 286 and "Rolled back" in response.content.decode()


def test_each_action_needs_its_role(
    fleet: Fleet, client: Client, viewer: User, operator: User, release_manager: User
) -> None:
    rollout = tick(start())
    client.force_login(viewer)
    assert client.get("/rollouts/new/").status_code == 403
    assert client.post(f"/rollouts/{rollout.pk}/abort/").status_code == 403
    client.force_login(operator)  # on-call: may roll a pool back, not steer a rollout
    assert client.post(f"/rollouts/{rollout.pk}/pause/").status_code == 403
    switched = client.post("/rollouts/release/gpu/rag/last-good/", follow=True)
    assert "rag on gpu has no earlier good release" in switched.content.decode()
    client.force_login(release_manager)
    client.post(f"/rollouts/{rollout.pk}/abort/")
    assert Rollout.objects.get(pk=rollout.pk).state == State.ABORTING
    denied = AuditEvent.objects.filter(result="denied").values_list("actor", "action")
    assert set(denied) == {
        ("viewer-user", "rollout.start"),
        ("viewer-user", "rollout.act"),
        ("operator-user", "rollout.act"),
    }


def test_the_timeline_opens_on_a_rollouts_span(
    fleet: Fleet, client: Client, viewer: User, settings: Any
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"
    rollout = tick(start())
    client.force_login(viewer)
    page = client.get(f"/audit/timeline/?rollout={rollout.pk}").content.decode()
    assert f"rollout #{rollout.pk}: rag v1 → v2 on gpu" in page
    assert "rollout.start" in page and "rollout.step" in page


# A pool behind a balancer: exact shares by weight -----------------------------------------------


@dataclass
class Weights:
    """The balancer's server weights, as HAProxy would hold them."""

    weights: dict[str, int]

    def sync(
        self, wanted: dict[str, int], places: dict[str, balancing.Place], gone: set[str]
    ) -> Synced:
        changed = {n: self.weights[n] for n, w in wanted.items() if self.weights[n] != w}
        self.weights |= wanted
        return Synced(dict(self.weights), changed, {})

    def in_flight(self, node: str) -> int:
        return 0


def synced(rollout: Rollout) -> dict[str, int]:
    """The balancer's weights once the sync that follows a commit has run (these tests run in
    a transaction that never commits): the pool's weights go to it only then."""
    balancing.traffic_sync(rollout.pool_id)
    return balancing.balancer(rollout.pool).weights  # type: ignore[union-attr]


@pytest.fixture
def weighted(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> Weights:
    NodePool.objects.filter(name="gpu").update(traffic=NodePool.Traffic.HAPROXY)
    balancer = Weights(dict.fromkeys(["gpu-1", "gpu-2", "gpu-3"], 100))
    monkeypatch.setattr(balancing, "balancer", lambda pool: balancer if pool.traffic else None)
    return balancer


def test_a_weighted_pool_gives_a_percent_step_its_share_and_an_abort_none_first(
    fleet: Fleet, weighted: Weights
) -> None:
    proposal = rollout_propose(model_name="rag", pool_name="gpu", canary_version=2, plan="5%\n100%")
    assert proposal.preview[0].real_share == "5% of requests, weighted on 1 of 3 nodes"
    assert not proposal.preview[0].overshoots  # no consent needed: the share is the one asked
    rollout = tick(start(plan="10%, hold 0s\n50%, hold 0s\n100%"))
    assert synced(rollout) == {"gpu-1": 22, "gpu-2": 99, "gpu-3": 99}
    fleet.converge()
    rollout = tick(tick(rollout))
    assert (rollout.step, synced(rollout)) == (1, {"gpu-1": 50, "gpu-2": 50, "gpu-3": 100})
    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    assert synced(rollout) == {"gpu-1": 0, "gpu-2": 0, "gpu-3": 100}
    # No request reaches the canary from before its nodes are told to go back to the baseline.
    parts = AuditEvent.objects.get(action="rollout.aborting").after["parts"]
    assert [part["action"] for part in parts] == ["pool.set_weights", *["deployment.remove"] * 2]
    assert parts[0]["after"] == {"weights": {"gpu-1": 0, "gpu-2": 0}}
    fleet.converge()
    assert tick(rollout).state == State.ROLLED_BACK
    assert synced(rollout) == dict.fromkeys(["gpu-1", "gpu-2", "gpu-3"], 100)


def test_the_rollout_page_shows_the_share_intended_and_the_one_observed(
    fleet: Fleet, weighted: Weights, client: Client, viewer: User
) -> None:
    rollout = tick(start(plan="10%, hold 10m\n100%"))
    fleet.requests = {"gpu-1": 19.0, "gpu-2": 90.0, "gpu-3": 91.0}
    client.force_login(viewer)
    waiting = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "Canary share" not in waiting  # before the canary is READY: the last step's traffic
    fleet.converge()
    rollout = tick(rollout)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "of the requests of the last 30 s" in page
    assert (
        "Canary share: intended <strong>10%</strong> (weighted), observed <strong>9.5%</strong>"
        in page
    )
    fleet.requests = {}
    assert (
        "observed <strong>\u2013</strong>"
        in client.get(f"/rollouts/{rollout.pk}/").content.decode()
    )


def test_the_rollout_page_draws_the_statistical_judges_latest_samples(
    fleet: Fleet, client: Client, viewer: User
) -> None:
    rollout = tick(start(judge="statistical"))
    evidence = {"canary": [210.0, 190], "baseline": [100.0, 98], "u": 4.0, "p": 0.0123}
    for when, verdict in ((1, "success"), (2, "failure")):  # the later one is drawn
        Measurement.objects.create(
            rollout=rollout,
            step=0,
            kind=Kind.LATENCY,
            metric="latency (samples)",
            query="q",
            verdict=verdict,
            evidence=evidence | {"effect": float(when), "verdict": verdict},
        )
    client.force_login(viewer)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "The judge's evidence" in page
    assert page.count('data-figure-id="evidence-') == 1
    assert "latency (samples): failure" in page
    assert "U = 4, p = 0.0123, effect +2, step 1 at" in page
    assert '{"type":"box","name":"canary","x":[210.0,190],"boxpoints":"all"' in page


def test_a_dry_run_records_every_verdict_and_acts_on_none(
    fleet: Fleet, client: Client, viewer: User
) -> None:
    fleet.verdict = "failure"
    rollout = tick(start(dry_run="true", failure_limit=1))
    fleet.converge()
    rollout = tick(tick(rollout))  # READY, then measured: a failure, and the next step goes out
    assert rollout.measurements.filter(verdict="failure").exists()
    assert (rollout.state, rollout.step, rollout.failures) == (State.PROGRESSING, 1, 0)
    fleet.verdict = "error"  # Prometheus away: recorded, never an abort either
    fleet.converge()
    for _ in range(3):
        rollout = tick(rollout)
    assert rollout.state in (State.PROGRESSING, State.PROMOTING)
    assert rollout.measurements.filter(verdict="error").exists()
    client.force_login(viewer)
    assert ">dry run</span>" in client.get(f"/rollouts/{rollout.pk}/").content.decode()
    with pytest.raises(PlanError, match=r"analysis\.dry_run: 'maybe' is not true or false"):
        Analysis.from_dict({"dry_run": "maybe"})


# Analysis templates ----------------------------------------------------------------------------


def test_a_template_is_versioned_audited_and_judges_the_rollouts_that_name_it(
    fleet: Fleet, client: Client, release_manager: User
) -> None:
    first = template_save(name="careful", analysis={"judge": "statistical"}, actor="ops")
    assert template_save(name="careful", analysis={"judge": "statistical"}, actor="ops") == first
    second = template_save(
        name="careful",
        analysis={"judge": "statistical", "window_s": 120},
        model_name="rag",
        actor="ops",
    )
    assert (first.version, second.version) == (1, 2)
    saves = AuditEvent.objects.filter(action="analysis_template.save").order_by("id")
    assert [e.after["version"] for e in saves] == [1, 2]
    rollout = start(template="careful", window_s=90)  # a field given overrides the template's
    assert rollout.template == second
    assert (rollout.analysis["judge"], rollout.analysis["window_s"]) == ("statistical", 90)
    assert AuditEvent.objects.get(action="rollout.start").after["template"] == "careful v2"
    client.force_login(release_manager)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "judged by the analysis template careful v2" in page
    form = client.get("/rollouts/new/").content.decode()
    assert '<option value="careful">careful</option>' in form
    # A retry is judged as the rollout it repeats was: by the same version of the template.
    template_save(name="careful", analysis={"judge": "threshold"}, model_name="rag", actor="ops")
    rollout_abort(rollout_id=rollout.pk, actor="ops")
    fleet.converge()
    assert tick(rollout).state == State.ROLLED_BACK
    again = rollout_retry(rollout_id=rollout.pk, actor="ops")
    assert (again.template, again.analysis) == (second, rollout.analysis)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"name": "Bad Name", "analysis": {}}, "template name 'Bad Name': lowercase"),
        ({"name": "t", "analysis": {"window_s": "x"}}, r"analysis\.window_s: 'x' is not a number"),
        ({"name": "t", "analysis": {}, "model_name": "nope"}, "no model 'nope'"),
        ({"name": "t", "analysis": {}, "pool_name": "nope"}, "no pool 'nope'"),
    ],
)
def test_a_template_that_cannot_judge_is_refused_with_why(
    fleet: Fleet, call: dict[str, Any], message: str
) -> None:
    with pytest.raises((RolloutError, PlanError), match=message):
        template_save(**call, actor="ops")
    assert not AnalysisTemplate.objects.exists()


def test_a_rollout_names_a_template_it_may_use(fleet: Fleet) -> None:
    with pytest.raises(RolloutError, match="no analysis template 'nope'"):
        start(template="nope")
    NodePool.objects.create(name="cpu")
    template_save(name="cpu-only", analysis={}, pool_name="cpu", actor="ops")
    with pytest.raises(RolloutError, match="analysis template cpu-only v1 is for cpu, not gpu"):
        start(template="cpu-only")


# The performance gate before traffic: each side with its own config, in turn ------------------


def measured(run: PerfRun, rate: float) -> None:
    """The run as a worker leaves it: done, its figures at concurrency 4."""
    run.points.create(
        concurrency=4, throughput=rate, p50_ms=20, p90_ms=25, p99_ms=30, queue_us=0, compute_us=0
    )
    PerfRun.objects.filter(pk=run.pk).update(status="done", finished_at=timezone.now())


def next_run(fleet: Fleet, rollout: Rollout) -> tuple[Rollout, PerfRun]:
    """Ticks (the fleet converging between them) until the gate starts its next run."""
    runs = PerfRun.objects.filter(purpose__startswith=f"rollout #{rollout.pk},")
    before = runs.count()
    for _ in range(3):
        fleet.converge()
        rollout = tick(rollout)
        if runs.count() > before:
            return rollout, runs.latest("id")
    raise AssertionError(f"no run started: {rollout.state} {rollout.reason}")


@pytest.fixture
def perf_gated(fleet: Fleet, weighted: Weights) -> Rollout:
    """rag v1 -> v2 on the weighted pool, with the performance gate at 4 users."""
    inputs = [{"X": {"datatype": "FP32", "shape": [1], "data": [1.0]}}]
    Model.objects.filter(name="rag").update(sample_inputs=inputs)
    rollout = tick(start(perf_concurrency="4", plan="1 node, hold 10m\n100%"))
    assert synced(rollout)["gpu-1"] == 0  # drained before the canary loads
    return rollout


@pytest.mark.parametrize(("rate", "verdict"), [(48.0, "success"), (30.0, "failure")])
def test_the_performance_gate_measures_each_side_with_its_own_config_in_turn(
    fleet: Fleet, perf_gated: Rollout, rate: float, verdict: str
) -> None:
    rollout, sides = perf_gated, []
    for each in (rate, 50.0, 50.0, rate):  # canary, baseline, baseline, canary
        rollout, run = next_run(fleet, rollout)
        sides.append((run.version, run.node_name, fleet.served["gpu-1"], synced(rollout)["gpu-1"]))
        measured(run, each)
    # Each side served alone with its own config: the baseline without the canary beside it.
    assert sides == [
        (2, "gpu-1", {1, 2}, 0),
        (1, "gpu-1", {1}, 0),
        (1, "gpu-1", {1}, 0),
        (2, "gpu-1", {1, 2}, 0),
    ]
    rollout = tick(rollout)
    gate = Measurement.objects.get(rollout=rollout, metric="throughput at concurrency 4")
    assert (gate.round.kind, gate.verdict, gate.canary_value, gate.baseline_value) == (
        "perf",
        verdict,
        rate,
        50.0,
    )
    if verdict == "success":
        assert rollout.perf_passed_at is not None and rollout.state == State.PROGRESSING
        assert synced(rollout)["gpu-1"] > 0  # passed: the step's share of requests
    else:
        assert rollout.state == State.ABORTING and synced(rollout)["gpu-1"] == 0
        assert rollout.reason == (
            "performance gate failed before any traffic: at concurrency 4, the canary served "
            "30.0 requests a second, the baseline 50.0: more than 10% fewer"
        )


def test_a_gate_run_that_fails_pauses_with_its_reason_and_a_resume_measures_afresh(
    fleet: Fleet, perf_gated: Rollout
) -> None:
    rollout, run = next_run(fleet, perf_gated)
    measured(run, 50.0)
    rollout, run = next_run(fleet, rollout)  # the baseline, the node switched to it
    PerfRun.objects.filter(pk=run.pk).update(
        status="failed", error="gpu-1: rag v1: perf_analyzer did not finish in 60 s"
    )
    rollout = tick(rollout)
    assert (rollout.state, rollout.reason) == (
        State.PAUSED,
        "performance gate: gpu-1: rag v1: perf_analyzer did not finish in 60 s; resume to run "
        "it again",
    )
    assert rollout.perf_passed_at is None and not rollout.perf_runs.exists()
    assert synced(rollout)["gpu-1"] == 0
    fleet.converge()  # the node asked to serve the canary again, drained
    assert fleet.served["gpu-1"] == {1, 2}
    rollout_resume(rollout_id=rollout.pk, actor="release-manager")
    rollout, run = next_run(fleet, Rollout.objects.get(pk=rollout.pk))
    assert (run.version, rollout.perf_runs.count()) == (2, 1)  # from the first run again
