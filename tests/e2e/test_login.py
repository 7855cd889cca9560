import re

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Deployment, Node, NodePool
from apps.registry.imports import repository_import
from apps.registry.models import Model
from tests.support import REPOSITORY
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NAVIGATION = ["Overview", "Nodes", "Models", "Rollouts", "Metrics", "Timeline", "Audit"]


def test_anonymous_visitor_lands_on_the_login_page(page: Page, live_server: object) -> None:
    page.goto(f"{live_server}/audit/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/audit/"))
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    expect(page.get_by_role("navigation", name="Main")).to_have_count(0)
    screenshot(page, "login")


def test_signed_in_user_sees_the_navigation_and_every_page(
    page: Page, live_server: object, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    user = make_user(Role.OPERATOR)
    # The demo fleet as the README shows it: rag_pipeline v1 deployed, loaded and read back.
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="demo")
    Deployment.objects.create(pool=pool, model=Model.objects.get(name="rag_pipeline"), version=1)
    steps = ["embedder", "retriever", "reranker", "generator", "rag_pipeline"]
    for i in range(1, 4):
        Node.objects.create(
            name=f"demo-{i}",
            pool=pool,
            http_url=f"http://127.0.0.1:{8097 + 3 * i}",
            health=Node.Health.READY,
            triton_version="2.51.0",
            index=[{"model": m, "version": 1, "state": "READY", "reason": ""} for m in steps],
            owned=steps,
            last_seen=timezone.now(),
        )
    sign_in(page, str(live_server), user.username)
    nav = page.get_by_role("navigation", name="Main")
    for label in NAVIGATION:
        expect(nav.get_by_role("link", name=label)).to_be_visible()
    expect(page.get_by_role("cell", name="rag_pipeline v1")).to_have_count(3)
    screenshot(page, "nodes")
    for label in NAVIGATION:
        with page.expect_response(lambda r: r.request.resource_type == "document") as loaded:
            nav.get_by_role("link", name=label).click()
        assert "script-src 'self' 'nonce-" in loaded.value.headers["content-security-policy"]
        expect(nav.get_by_role("link", name=label)).to_have_attribute("aria-current", "page")
        expect(page.locator("main h1")).to_have_text(
            re.compile(label if label != "Overview" else "Fleet")
        )
        if label in ("Metrics", "Timeline"):  # charts say why they are empty, the page still works
            expect(page.locator(".chart-message")).to_contain_text("did not answer")
        screenshot(page, label.lower())
    # Every script ran under the CSP: nothing blocked, nothing thrown.
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_csp_violation_reaches_the_console_the_tests_check(
    page: Page, live_server: object
) -> None:
    """The pages' console is asserted empty: this shows a violation would be in it."""
    page.goto(f"{live_server}/accounts/login/")
    foreign = '<img alt="" src="http://203.0.113.9/x.png">'  # img-src is 'self' and data: only
    with page.expect_console_message(lambda m: "CSP violation: img-src" in m.text):
        page.evaluate("html => document.body.insertAdjacentHTML('beforeend', html)", foreign)
    assert page.console_errors  # type: ignore[attr-defined]
