"""Blue-green releases of a pipeline, with the nodes stubbed at their boundary (what they report,
`observed_many`) and evaluation runs finished straight in the database. The same path runs on
real Triton nodes behind HAProxy in tests/integration/test_blue_green.py."""

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.fleet import selectors
from apps.fleet.desired import fleet_desired
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.runner import _loads_nothing
from apps.fleet.services.deployments import deployment_set
from apps.quality.models import EvaluationRun
from apps.quality.services import evaluation_set_import
from apps.registry.models import ModelVersion
from apps.rollouts import ending
from apps.rollouts.forms import RolloutForm
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.proposals import RolloutError, rollout_propose, rollout_start
from apps.rollouts.services import rollout_abort
from apps.rollouts.tick import rollout_advance
from tests.support import ROOT
from tests.support.registry import import_demo
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db
State = Rollout.State
STEP_SET = ROOT / "deploy" / "evaluations" / "retriever-faq.jsonl"
QUALITY = {"quality_set": "faq", "quality_min_score": 0.9, "quality_tolerance": 0.05}


class Nodes:
    """The pool's nodes as the reconciler would leave them: each serving its desired state once
    `converge()` runs."""

    def __init__(self, pool: NodePool) -> None:
        self.pool = pool
        self.served: dict[tuple[int, str], set[int]] = {}
        self.since: datetime | None = None  # since when they serve it: now, unless set

    def converge(self) -> None:
        desired = fleet_desired(pool_ids=[self.pool.pk])
        self.served = {
            (node.pk, name): set(model.versions)
            for node in self.pool.nodes.all()
            for name, model in desired.of(node).items()
        }

    def observed(
        self, nodes: list[Node], models: list[str]
    ) -> dict[tuple[int, str], tuple[set[int], datetime]]:
        now = self.since or timezone.now()
        return {
            (n.pk, m): (set(self.served.get((n.pk, m), set())), now) for n in nodes for m in models
        }


@pytest.fixture
def users(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """What Prometheus says users got since a switch: requests answered and failed, the P99
    (ms); its client stubbed (the real one is in tests/integration/test_blue_green.py)."""
    said = {"ok": 0.0, "failed": 0.0, "p99": 100.0}

    def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
        name = "failed" if "failure" in query else "p99" if "summary" in query else "ok"
        return [({}, said[name])]

    monkeypatch.setattr(ending, "instant_query", instant_query)
    return said


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Nodes]:
    """The demo registry on a pool of three nodes serving rag_pipeline v1, and the retriever's
    evaluation set."""
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    evaluation_set_import(
        model_name="retriever", name="faq", text=STEP_SET.read_text(), actor="release-manager"
    )
    pool = NodePool.objects.create(name="trio", rollback_window_s=600)
    for name in ("t-1", "t-2", "t-3"):
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="ops")
    stub = Nodes(pool)
    stub.converge()
    monkeypatch.setattr(selectors, "observed_many", stub.observed)
    yield stub


def start(version: int = 8, **analysis: Any) -> Rollout:
    return rollout_start(
        model_name="rag_pipeline",
        pool_name="trio",
        canary_version=version,
        plan="",
        analysis=QUALITY | analysis,
        actor="release-manager",
        strategy=Rollout.Strategy.BLUE_GREEN,
    )


def tick(rollout: Rollout) -> Rollout:
    rollout_advance(rollout_id=rollout.pk)
    return Rollout.objects.get(pk=rollout.pk)


def finish(rollout: Rollout, scores: dict[str, float]) -> None:
    """Each node's run done, with the new version's score there (the old one's is 1.0)."""
    for run in rollout.gate_runs.select_related("node"):
        score = scores[run.node.name]  # type: ignore[union-attr]
        run.status, run.score, run.baseline_score = EvaluationRun.Status.DONE, score, 1.0
        run.passed, run.failed = round(30 * score), 30 - round(30 * score)
        run.finished_at = timezone.now()
        run.save()


def pooled() -> tuple[int, int | None, int | None]:
    found = Deployment.objects.get(pool__name="trio", model__name="rag_pipeline")
    return found.version, found.baseline_version, found.standby_version


def test_a_standby_pipeline_loads_its_steps_beside_and_serves_nothing_new(nodes: Nodes) -> None:
    deployment_set(model_name="rag_pipeline", version=1, standby=8, pool=nodes.pool, actor="ops")
    desired = fleet_desired(pool_ids=[nodes.pool.pk]).of(nodes.pool.nodes.first())  # type: ignore[arg-type]
    assert {name: model.versions for name, model in desired.items()} == {
        "rag_pipeline": (1,),  # with v1's config: it pins retriever 1
        "embedder": (1,),
        "retriever": (1, 3),
        "reranker": (1,),
        "generator": (1,),
    }
    assert desired["rag_pipeline"].config["version_policy"] == {"specific": {"versions": ["1"]}}


def test_a_pipeline_switching_to_loaded_steps_loads_nothing() -> None:
    import_demo()
    pool = NodePool.objects.create(name="p")
    node = Node.objects.create(name="n", pool=pool, http_url="http://n:8000")
    ready = [("rag_pipeline", 1), ("embedder", 1), ("retriever", 1), ("reranker", 1)]
    node.index = [{"model": m, "version": str(v), "state": "READY"} for m, v in ready]
    v8 = ModelVersion.objects.get(model__name="rag_pipeline", version=8).config

    def load(model: str, versions: list[int], config: dict | None = None) -> Operation:
        return Operation(node=node, kind="load", model_name=model, versions=versions, config=config)

    # v8 pins retriever 3 and generator 1, which are not READY yet: a real load.
    assert not _loads_nothing(node, [load("rag_pipeline", [8], v8)])  # type: ignore[arg-type]
    node.index += [
        {"model": "retriever", "version": "3", "state": "READY"},
        {"model": "generator", "version": "1", "state": "READY"},
    ]
    assert _loads_nothing(node, [load("rag_pipeline", [8], v8)])  # type: ignore[arg-type]
    narrowing = load("retriever", [3])
    assert _loads_nothing(node, [load("rag_pipeline", [8], v8), narrowing])  # type: ignore[arg-type]
    assert not _loads_nothing(node, [load("embedder", [1, 2])])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "version", "analysis", "message"),
    [
        ("retriever", 3, QUALITY, "retriever is not a pipeline: blue-green switches a pipeline"),
        ("rag_pipeline", 8, {}, "name an evaluation set (quality_set)"),
        (
            "rag_pipeline",
            2,
            QUALITY,
            "step embedder (v1 -> v2) has no evaluation set 'faq' to validate it",
        ),
    ],
)
def test_a_release_blue_green_cannot_switch_is_refused_in_words(
    nodes: Nodes, model: str, version: int, analysis: dict[str, Any], message: str
) -> None:
    if model == "retriever":
        deployment_set(model_name="retriever", version=1, pool=nodes.pool, actor="ops")
    with pytest.raises(RolloutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rollout_propose(
            model_name=model,
            pool_name="trio",
            canary_version=version,
            plan="",
            analysis=analysis,
            strategy=Rollout.Strategy.BLUE_GREEN,
        )


def test_a_release_that_changes_no_step_has_nothing_to_stand_by(nodes: Nodes) -> None:
    deployment_set(model_name="rag_pipeline", version=8, pool=nodes.pool, actor="ops")
    config = ModelVersion.objects.get(model__name="rag_pipeline", version=8).config
    ModelVersion.objects.create(
        model=ModelVersion.objects.get(model__name="rag_pipeline", version=8).model,
        version=99,
        config=config | {"version_policy": {"specific": {"versions": ["99"]}}},
        status=ModelVersion.Status.PUBLISHED,
    )
    with pytest.raises(RolloutError, match="pins the same step versions as v8"):
        start(99)


def test_a_passing_release_stands_by_is_evaluated_on_every_node_then_switches(
    nodes: Nodes, users: dict[str, float]
) -> None:
    rollout = tick(start())
    assert rollout.state == State.PROGRESSING and rollout.plan == [{"percent": 100, "hold_s": 0}]
    assert pooled() == (1, None, 8)  # v1 serves; v8's steps load beside it
    assert tick(rollout).step_ready_at is None  # the standby is not loaded yet
    nodes.converge()
    rollout = tick(rollout)
    runs = list(rollout.gate_runs.order_by("node__name"))
    assert [(r.node.name, r.baseline_node.name, r.version, r.baseline_version) for r in runs] == [  # type: ignore[union-attr]
        (f"t-{n}", f"t-{n}", 3, 1) for n in (1, 2, 3)
    ]
    assert {r.evaluation_set.model.name for r in runs} == {"retriever"}
    assert tick(rollout).state == State.PROGRESSING  # the runs are under way
    finish(rollout, {"t-1": 1.0, "t-2": 1.0, "t-3": 0.97})
    rollout = tick(rollout)
    assert rollout.state == State.PROMOTING and rollout.gate_passed_at
    # Switched in the same tick: v8 serves, v1 (and retriever 1) kept for the rollback window.
    assert pooled() == (8, 1, None)
    found = Measurement.objects.get(rollout=rollout)
    assert (found.metric, found.verdict, found.canary_value) == (
        "quality before the switch: retriever",
        "success",
        0.97,
    )
    nodes.converge()
    nodes.since = timezone.now() - timedelta(seconds=30)
    rollout = tick(rollout)  # every node serves v8: users' requests are watched
    assert rollout.state == State.PROMOTING
    assert rollout.reason == (
        "0 requests in 30 s since the switch, 20 needed to judge it: waiting for more"
    )
    users["ok"] = 100.0
    assert tick(rollout).reason == "switched 30 s ago, watched for 60 s: 100 requests, 0.0% failed"
    nodes.since = timezone.now() - timedelta(seconds=61)
    assert tick(rollout).state == State.SUCCEEDED


def test_a_switched_release_that_fails_users_rolls_back_by_itself(
    nodes: Nodes, users: dict[str, float]
) -> None:
    rollout = tick(start())
    nodes.converge()
    rollout = tick(rollout)
    finish(rollout, {"t-1": 1.0, "t-2": 1.0, "t-3": 1.0})
    rollout = tick(rollout)
    nodes.converge()
    nodes.since = timezone.now() - timedelta(seconds=20)
    users["ok"], users["failed"] = 90.0, 10.0
    rollout = tick(rollout)
    assert rollout.state == State.ABORTING
    assert rollout.reason == (
        "rolled back by itself after the switch: 10.0% of 100 requests failed in 20 s, at most 1.0%"
    )
    assert pooled() == (1, None, None)  # back on the release before, still loaded: it narrows
    nodes.converge()
    assert tick(rollout).state == State.ROLLED_BACK


def test_a_release_failing_on_one_node_lets_the_standby_go(nodes: Nodes) -> None:
    rollout = tick(start(9))
    nodes.converge()
    rollout = tick(rollout)
    finish(rollout, {"t-1": 1.0, "t-2": 0.27, "t-3": 1.0})
    rollout = tick(rollout)
    assert rollout.state == State.ABORTING
    assert rollout.reason.startswith(
        "failed before the switch, still serving the release before: quality before the switch:"
        " retriever: t-2: canary scored 27% (8 of 30 cases), below 90%"
    )
    assert pooled() == (1, None, None)
    assert tick(rollout).state == State.ABORTING  # until retriever 4 is gone from every node
    nodes.converge()
    rollout = tick(rollout)
    assert rollout.state == State.ROLLED_BACK
    assert all(nodes.served[(n.pk, "retriever")] == {1} for n in nodes.pool.nodes.all())


def test_an_abort_on_standby_keeps_the_rollback_window_it_found(nodes: Nodes) -> None:
    until = timezone.now() + timedelta(seconds=300)
    Deployment.objects.filter(pool=nodes.pool).update(baseline_version=2, baseline_until=until)
    rollout = tick(start())
    assert pooled() == (1, 2, 8)
    rollout_abort(rollout_id=rollout.pk, actor="release-manager", reason="not today")
    assert pooled() == (1, 2, None)


def test_an_unfinished_evaluation_pauses_and_a_resume_runs_it_again(nodes: Nodes) -> None:
    rollout = tick(start(quality_timeout_s=1))
    nodes.converge()
    rollout = tick(rollout)
    first = set(rollout.gate_runs.values_list("pk", flat=True))
    EvaluationRun.objects.filter(pk__in=first).update(
        created_at=timezone.now() - timedelta(hours=1)
    )
    rollout = tick(rollout)
    assert rollout.state == State.PAUSED
    assert "did not finish in time" in rollout.reason
    Rollout.objects.filter(pk=rollout.pk).update(state=State.PROGRESSING)
    rollout = tick(rollout)
    assert rollout.gate_runs.count() == 3 and not first & set(
        rollout.gate_runs.values_list("pk", flat=True)
    )


def test_the_form_previews_and_the_api_starts_a_blue_green_release(
    nodes: Nodes, client: Client
) -> None:
    manager = make_user(Role.RELEASE_MANAGER)
    client.force_login(manager)
    defaults = {k: f.initial for k, f in RolloutForm.base_fields.items() if f.initial is not None}
    form = defaults | {
        "model": "rag_pipeline",
        "pool": "trio",
        "canary_version": 8,
        "strategy": "blue_green",
        "plan": "100%",
        "quality_set": "faq",
    }
    evaluation_set_import(
        model_name="rag_pipeline",
        name="faq",
        text=(ROOT / "deploy" / "evaluations" / "rag_pipeline-faq.jsonl").read_text(),
        actor="release-manager",
    )
    preview = client.post("/rollouts/new/", {**form, "preview": ""}).content.decode()
    assert 'id="blue-green-plan"' in preview
    assert "evaluated on every node by each step's evaluation set faq" in preview
    body = {
        "model": "rag_pipeline",
        "pool": "trio",
        "canary_version": 9,
        "plan": "",
        "strategy": "blue_green",
        "analysis": QUALITY,
    }
    started = client.post(
        "/api/rollouts", body, content_type="application/json", headers=bearer(manager)
    )
    assert started.status_code == 201, started.content
    assert started.json()["strategy"] == "blue_green"


def test_the_page_lists_each_nodes_evaluation_worst_first(nodes: Nodes, client: Client) -> None:
    rollout = tick(start(9))
    nodes.converge()
    rollout = tick(rollout)
    finish(rollout, {"t-1": 1.0, "t-2": 0.27, "t-3": 1.0})
    rollout = tick(rollout)
    client.force_login(make_user(Role.VIEWER))
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "3 of 3 runs finished; 2 scored 90% at least." in page
    listed = [page.index(f"<tr><td>t-{n}</td>") for n in (2, 1, 3)]
    assert listed == sorted(listed)  # t-2, the failing node, first
    assert 'id="switch-verdict">failure' in page


def test_the_preview_says_where_the_standby_would_not_fit_in_memory(nodes: Nodes) -> None:
    from apps.fleet.services.nodes import node_set_memory

    ModelVersion.objects.filter(model__name="retriever").update(memory_mb=300)
    node_set_memory(node_name="t-2", limit_mb=500, actor="sre")  # retriever 1 fits, not 3 too
    proposal = rollout_propose(
        model_name="rag_pipeline",
        pool_name="trio",
        canary_version=8,
        plan="",
        analysis=QUALITY,
        strategy=Rollout.Strategy.BLUE_GREEN,
    )
    assert len(proposal.memory) == 1
    assert proposal.memory[0].startswith("t-2 needs ")
    assert "for retriever v3" in proposal.memory[0]


def test_the_page_costs_the_same_queries_however_many_nodes_were_evaluated(
    nodes: Nodes, client: Client
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    rollout = tick(start(9))
    nodes.converge()
    rollout = tick(rollout)
    finish(rollout, {"t-1": 1.0, "t-2": 0.27, "t-3": 1.0})
    client.force_login(make_user(Role.VIEWER))

    def queries() -> int:
        with CaptureQueriesContext(connection) as seen:
            assert client.get(f"/rollouts/{rollout.pk}/").status_code == 200
        return len(seen)

    before = queries()
    first = rollout.gate_runs.first()
    assert first is not None
    for n in range(4, 40):
        node = Node.objects.create(name=f"t-{n}", pool=nodes.pool, http_url=f"http://t-{n}:8000")
        first.pk, first.node = None, node
        first.save()
        rollout.gate_runs.add(first)
    assert rollout.gate_runs.count() == 39
    assert queries() == before
