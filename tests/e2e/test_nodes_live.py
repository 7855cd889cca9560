"""The nodes page on 3 real Triton nodes: live states, and a load from the node's page read back
READY."""

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from tests.support.browser import screenshot, sign_in
from tests.support.fleet import ready_on
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_nodes_page_shows_live_states_and_a_load_from_the_page_ends_ready(
    pool: NodePool,
    page: Page,
    live_server: object,
) -> None:
    user = make_user(Role.OPERATOR)
    sign_in(page, str(live_server), user.username)
    page.goto(f"{live_server}/nodes/")
    for node in pool.nodes.all():
        expect(page.locator(f"#node-{node.name}")).to_contain_text("Ready", timeout=30_000)
    screenshot(page, "nodes-live")
    page.get_by_role("link", name="trio-1").click()
    # Its form asks for a confirmation once htmx is bound to it: at the page's load.
    page.wait_for_url(f"{live_server}/nodes/trio-1/")
    page.wait_for_load_state()
    page.get_by_label("Model and version").select_option(label="rag_pipeline v2")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.get_by_role("button", name="Load", exact=True).click()
    expect(page.locator(".flash")).to_contain_text("Loading rag_pipeline v2 on trio-1")
    assert asked == ["Load rag_pipeline v2 on trio-1?"]
    row = page.locator("#model-rag_pipeline")
    expect(row).to_contain_text("v2 READY", timeout=90_000)
    expect(page.locator("#model-reranker")).to_contain_text("v2 READY")
    screenshot(page, "node-detail-loaded")
    assert ("rag_pipeline", 2) in ready_on(Node.objects.get(name="trio-1"))
