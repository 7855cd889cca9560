from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.accounts.services import user_ensure
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.pools import pool_set_protected
from apps.registry.imports import repository_import
from tests.support.browser import screenshot, sign_in
from tests.support.users import PASSWORD, make_user

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_on_a_protected_pool_a_rollback_goes_alone_and_a_deployment_waits(
    page: Page, live_server: object
) -> None:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    for version in (1, 2):
        deployment_set(model_name="rag_pipeline", version=version, pool=pool, actor="ops")
    pool_set_protected(pool_name="gpu", protected=True, actor="ops")
    make_user(Role.VIEWER)
    for name in ("ann", "bob"):
        user_ensure(username=name, password=PASSWORD, role=Role.RELEASE_MANAGER)
    base = str(live_server)
    sign_in(page, base, "ann")
    page.goto(f"{base}/rollouts/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#releases tbody tr", has_text="rag_pipeline").get_by_role(
        "button", name="Roll back to v1"
    ).click()
    expect(page.locator(".flash")).to_contain_text("Pool gpu is switching rag_pipeline to v1")
    assert Deployment.objects.get(pool=pool).version == 1  # a move back waits for nobody
    page.goto(f"{base}/deployments/")
    section = page.locator("#pool-gpu")
    section.get_by_label("Deploy").select_option(label="rag_pipeline v2")
    page.once("dialog", lambda dialog: dialog.accept())
    section.get_by_role("button", name="Deploy to gpu").click()
    expect(page).to_have_url(f"{base}/rollouts/approvals/")
    expect(page.locator(".flash")).to_contain_text("Pool gpu is protected: deployment.set")
    row = page.locator("#approvals tbody tr").first
    expect(row).to_contain_text("pending until")
    expect(row.get_by_role("button", name="Approve")).to_have_count(0)  # not hers to approve
    screenshot(page, "approvals-pending")
    assert Deployment.objects.get(pool=pool).version == 1
    page.context.clear_cookies()
    sign_in(page, base, "bob")
    page.goto(f"{base}/rollouts/approvals/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#approvals tbody tr").first.get_by_role("button", name="Approve").click()
    expect(page.locator(".flash")).to_contain_text("deployment.set on gpu is approved")
    expect(page.locator("#approvals tbody tr").first).to_contain_text("approved by bob")
    screenshot(page, "approvals-approved")
    assert Deployment.objects.get(pool=pool).version == 2
    # Another request of ann's, which bob rejects with a reason she reads.
    page.context.clear_cookies()
    sign_in(page, base, "ann")
    page.goto(f"{base}/deployments/")
    section = page.locator("#pool-gpu")
    section.get_by_label("Deploy").select_option(label="embedder v2")
    page.once("dialog", lambda dialog: dialog.accept())
    section.get_by_role("button", name="Deploy to gpu").click()
    expect(page).to_have_url(f"{base}/rollouts/approvals/")
    page.context.clear_cookies()
    sign_in(page, base, "bob")
    page.goto(f"{base}/rollouts/approvals/")
    waiting = page.locator("#approvals tbody tr", has_text="pending until")
    waiting.get_by_label("Reason").fill("not during the demo")
    waiting.get_by_role("button", name="Reject").click()
    expect(page.locator(".flash")).to_contain_text("its requester sees why")
    page.context.clear_cookies()
    sign_in(page, base, "ann")
    page.goto(f"{base}/rollouts/approvals/")
    expect(page.locator("#approvals tbody tr").first).to_contain_text(
        "rejected by bob: not during the demo"
    )
    screenshot(page, "approvals-rejected")
    assert not Deployment.objects.filter(pool=pool, model__name="embedder").exists()
    assert page.console_errors == []  # type: ignore[attr-defined]
