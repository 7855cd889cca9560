"""The parts of pages that memory-aware loads, SLOs, lockstep releases and the rollback window
added, in Chromium: a refused load sent anyway with a reason typed while its page refreshes, the
rollout preview's memory warning and lockstep line, the rollout page's lockstep line, a model's
objectives and a pool's kept release. Registry from the demo's repository; no node is reached."""

from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_set_memory
from apps.registry.imports import repository_import
from apps.registry.services import version_set_memory
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"


@pytest.fixture
def pool() -> NodePool:
    """Pool `pair` of two nodes running the embedder and generator v1 and rag_pipeline v1;
    generator v2 declared at 300 MiB."""
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pair = NodePool.objects.create(name="pair")
    for name in ("pair-1", "pair-2"):
        Node.objects.create(name=name, pool=pair, http_url=f"http://{name}:8000", health="ready")
    for model in ("embedder", "generator", "rag_pipeline"):
        deployment_set(model_name=model, version=1, pool=pair, actor="system:test")
    version_set_memory(model_name="generator", version=2, memory_mb=300, actor="sre")
    return pair


def test_a_refused_load_is_sent_anyway_with_a_reason_typed_while_the_page_refreshes(
    pool: NodePool, page: Page, live_server: object
) -> None:
    node = Node.objects.get(name="pair-1")
    Operation.objects.create(
        node=node,
        kind="load",
        model_name="generator",
        versions=[2],
        status="failed",
        failure="memory",
        error="does not fit, not sent: generator v2 300 MiB (declared) needs 330 MiB with 10% "
        "headroom; the node's 256 MiB limit has 256 MiB free",
        requested_by="system:reconcile",
    )
    sign_in(page, str(live_server), make_user(Role.OPERATOR).username)
    page.goto(f"{live_server}/nodes/pair-1/")
    row = page.locator("#node-live tbody tr", has_text="load generator v2")
    expect(row).to_contain_text("would not fit: not sent")
    expect(row).to_contain_text("not tried again until a person retries it")
    reason = row.get_by_label("Reason to load generator anyway")
    reason.fill("the limit is set low for a drill")
    page.wait_for_timeout(3_000)  # the live part refreshes every 2 s; it keeps what was typed
    expect(reason).to_have_value("the limit is set low for a drill")
    screenshot(page, "node-refused-load")
    row.get_by_role("button", name="Load anyway").click()
    forced = page.locator("#node-live tbody tr", has_text="sent anyway")
    expect(forced).to_contain_text("sent anyway: the limit is set low for a drill")
    assert Operation.objects.filter(override="the limit is set low for a drill").exists()
    assert not page.console_errors  # type: ignore[attr-defined]


def test_the_rollout_preview_warns_of_memory_and_names_what_goes_in_lockstep(
    pool: NodePool, page: Page, live_server: object
) -> None:
    node_set_memory(node_name="pair-2", limit_mb=256, actor="sre")
    call_command("set_budgets", "rag_pipeline=200")
    call_command("set_slo", "rag_pipeline", "--availability", "0.999", "--latency", "0.99")
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    page.goto(f"{live_server}/models/rag_pipeline/")
    expect(page.get_by_text("SLO: 99.9% of requests succeed")).to_be_visible()
    screenshot(page, "model-slo")
    page.goto(f"{live_server}/rollouts/new/")
    page.get_by_label("Model").select_option("generator")
    page.get_by_label("Pool").select_option("pair")
    page.get_by_label("Canary version").select_option("2")
    page.get_by_label("Release with it (lockstep)").fill("embedder:2")
    page.get_by_label("Plan").fill("1 node\n100%")
    page.get_by_role("button", name="Preview").click()
    warning = page.locator("#memory-warning")
    expect(warning).to_contain_text("Will not fit in memory")
    expect(warning).to_contain_text("pair-2 needs 330 MiB with headroom for generator v2")
    expect(page.locator("#preview")).to_contain_text("With it, on the same nodes and as one:")
    expect(page.locator("#preview")).to_contain_text(
        "v1 kept loaded (not served) for the pool's 900 s rollback window where memory allows"
    )
    screenshot(page, "rollout-preview-memory")
    page.get_by_role("button", name="Start rollout").click()
    expect(page.locator("#lockstep")).to_contain_text("embedder v1 → v2")
    screenshot(page, "rollout-lockstep")
    assert not page.console_errors  # type: ignore[attr-defined]


def test_the_deployments_page_says_which_release_is_kept_and_until_when(
    pool: NodePool, page: Page, live_server: object
) -> None:
    until = timezone.now() + timedelta(minutes=15)
    deployment_set(
        model_name="rag_pipeline",
        version=2,
        pool=pool,
        baseline=1,
        baseline_until=until,
        actor="system:rollouts",
    )
    sign_in(page, str(live_server), make_user(Role.VIEWER).username)
    page.goto(f"{live_server}/deployments/")
    row = page.locator("#pool-pair tr", has_text="rag_pipeline")
    expect(row).to_contain_text(f"v1 kept until {until:%H:%M} UTC, for an instant rollback")
    screenshot(page, "deployments-rollback-window")
    assert not page.console_errors  # type: ignore[attr-defined]
