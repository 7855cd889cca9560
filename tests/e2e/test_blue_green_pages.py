"""A blue-green release in a browser: the rollout form previews one (standby, evaluated on every
node, one switch), and the page of one whose new index failed on a node lists every node's
evaluation, the failing node first. Rows are written straight to the database: no Triton."""

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Deployment, Node, NodePool
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.quality.services import evaluation_set_import
from apps.registry.models import Model
from apps.rollouts.models import Rollout, Round
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import record
from apps.rollouts.verdicts import Verdict
from tests.support import ROOT
from tests.support.browser import screenshot, sign_in
from tests.support.quality import demo_faq
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
STEP_SET = ROOT / "deploy" / "evaluations" / "retriever-faq.jsonl"


@pytest.fixture
def pool() -> NodePool:
    """The trio serving rag_pipeline v1, and the retriever's evaluation set."""
    demo_faq()
    evaluation_set_import(
        model_name="retriever", name="faq", text=STEP_SET.read_text(), actor="release-manager"
    )
    found = NodePool.objects.create(name="trio")
    for n in (1, 2, 3):
        Node.objects.create(name=f"trio-{n}", pool=found, http_url=f"http://127.0.0.1:{n}")
    Deployment.objects.create(
        pool=found, model=Model.objects.get(name="rag_pipeline"), version=1, created_by="ops"
    )
    return found


@pytest.fixture
def signed_in(page: Page, live_server: object, pool: NodePool) -> str:
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    return str(live_server)


def test_the_form_previews_a_blue_green_release(page: Page, signed_in: str) -> None:
    page.goto(f"{signed_in}/rollouts/new/")
    page.get_by_label("Model").select_option("rag_pipeline")
    page.get_by_label("Pool").select_option("trio")
    page.get_by_label("Canary version").select_option("8")
    page.get_by_label("Blue-green: loaded beside, evaluated, switched at once").check()
    page.get_by_label("Evaluation set").select_option("faq")
    page.get_by_role("button", name="Preview").click()
    plan = page.locator("#blue-green-plan")
    expect(plan).to_contain_text("standby: on every node (3), v8's new steps load beside")
    expect(plan).to_contain_text("evaluated on every node by each step's evaluation set faq")
    expect(plan).to_contain_text("switch: every node serves v8 at once")
    screenshot(page, "blue-green-form")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_release_whose_index_failed_on_a_node_lists_every_nodes_evaluation(
    page: Page, signed_in: str, pool: NodePool
) -> None:
    rollout = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        strategy=Rollout.Strategy.BLUE_GREEN,
        baseline_version=1,
        canary_version=9,
        plan=[{"percent": 100}],
        analysis={"quality_set": "faq"},
        state=Rollout.State.ROLLED_BACK,
        canary_nodes=["trio-1", "trio-2", "trio-3"],
        step_started_at=timezone.now(),
        step_ready_at=timezone.now(),
        started_by="release_manager-user",
        reason="failed before the switch, still serving the release before: quality before the"
        " switch: retriever: trio-2: canary scored 27% (8 of 30 cases), below 90%",
        finished_at=timezone.now(),
    )
    found = EvaluationSet.objects.get(model__name="retriever")
    for node in pool.nodes.all():
        score = 0.27 if node.name == "trio-2" else 1.0
        run = EvaluationRun.objects.create(
            evaluation_set=found,
            version=4,
            baseline_version=1,
            node=node,
            baseline_node=node,
            status=EvaluationRun.Status.DONE,
            score=score,
            baseline_score=1.0,
            passed=round(30 * score),
            failed=30 - round(30 * score),
            purpose=f"rollout #{rollout.pk}, before the switch",
            requested_by="system:rollouts",
            finished_at=timezone.now(),
        )
        rollout.gate_runs.add(run)
    switch = Result(
        "quality before the switch: retriever",
        "3 evaluation runs of retriever/faq v1, v4 against v1",
        0.27,
        1.0,
        0.9,
        Verdict.FAILURE,
        "trio-2: canary scored 27% (8 of 30 cases), below 90%",
        kind=Kind.QUALITY,
    )
    record(rollout, [switch], Verdict.FAILURE, Round.Kind.SWITCH)
    page.goto(f"{signed_in}/rollouts/{rollout.pk}/")
    expect(page.locator("#rollout-state")).to_have_text("Rolled back")
    section = page.locator("#switch-evaluations")
    expect(section).to_contain_text("3 of 3 runs finished; 2 scored 90% at least.")
    expect(page.locator("#switch-verdict")).to_have_text("failure")
    expect(section.locator("tbody tr").first).to_contain_text("trio-2")
    expect(section.locator("tbody tr").first).to_contain_text("v4 27%")
    expect(page.locator("ol.steps")).to_contain_text("evaluated on every node")
    screenshot(page, "blue-green-rollout")
    assert page.console_errors == []  # type: ignore[attr-defined]
