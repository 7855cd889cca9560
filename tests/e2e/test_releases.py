from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.imports import repository_import
from apps.registry.models import Model
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_on_call_rolls_a_pool_back_from_the_releases_table(page: Page, live_server: object) -> None:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    for version in (1, 2):
        deployment_set(
            model_name="rag_pipeline", version=version, pool=pool, actor="release-manager"
        )
    Model.objects.filter(name="rag_pipeline").update(fallback_version=4)
    user = make_user(Role.OPERATOR)
    sign_in(page, str(live_server), user.username)
    page.goto(f"{live_server}/rollouts/")
    row = page.locator("#releases tbody tr", has_text="rag_pipeline")
    expect(row).to_contain_text("v2")
    expect(row.get_by_role("button", name="Switch to fallback v4")).to_be_visible()
    screenshot(page, "rollouts-releases")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    row.get_by_role("button", name="Roll back to v1").click()
    expect(page.locator(".flash")).to_contain_text("Pool gpu is switching rag_pipeline to v1")
    after = page.locator("#releases tbody tr", has_text="rag_pipeline")
    expect(after).to_contain_text("v1")
    expect(after.get_by_role("button", name="Roll back to v2")).to_have_count(0)  # rolled from
    assert asked == ["Roll pool gpu back from rag_pipeline v2 to v1 on every node, now?"]
    assert Deployment.objects.get(pool=pool).version == 1
    screenshot(page, "rollouts-rolled-back")
    assert page.console_errors == []  # type: ignore[attr-defined]
