"""A rollout started from the form on 3 real Triton nodes under real traffic, followed on its
page, aborted from it, and reviewed on the timeline it links to."""

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import NodePool
from tests.support.browser import dark, screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_rollout_started_from_the_form_progresses_and_is_aborted(
    serving_v1: NodePool, traffic: None, page: Page, live_server: object
) -> None:
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    page.goto(f"{live_server}/rollouts/new/")
    page.get_by_label("Model").select_option("rag_pipeline")
    page.get_by_label("Pool").select_option("trio")
    page.get_by_label("Canary version").select_option("2")  # waits for the model's versions
    page.get_by_label("Plan").fill("1 node, hold 5m\n100%")
    page.get_by_label("Every (s)").fill("2")
    page.get_by_label("Window (s)").fill("10")
    page.get_by_label("Warm-up (s)").fill("5")
    page.get_by_label("Min requests").fill("5")
    # Verdicts are recorded, never acted on: the page is what is tested here, and a healthy
    # canary's samples on a machine shared with the integration tests can read worse.
    page.get_by_label("Dry run").check()
    page.get_by_role("button", name="Preview").click()
    preview = page.locator("#preview")
    expect(preview).to_contain_text("trio-1")  # the first canary node, by name
    screenshot(page, "rollout-new")
    page.get_by_role("button", name="Start rollout").click()
    expect(page.locator("#rollout-state")).to_have_text("Progressing", timeout=20_000)
    expect(page.locator("table.measurements")).to_contain_text("success", timeout=60_000)
    screenshot(page, "rollout-detail")
    with dark(page):
        expect(page.locator("table.measurements")).to_contain_text("success")
        screenshot(page, "rollout-detail-dark")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Abort and roll back").click()
    expect(page.locator("#rollout-state")).to_have_text("Rolled back", timeout=60_000)
    expect(page.locator("#rollout-live")).not_to_have_attribute("hx-trigger", "every 2s")
    screenshot(page, "rollout-rolled-back")
    page.get_by_role("link", name="Incident timeline").click()  # the review starts from here
    events = page.locator("#events")
    for action in ("rollout.start", "rollout.step", "rollout.aborting", "rollout.rolled_back"):
        expect(events).to_contain_text(action)
    expect(page.locator("#what-changed")).to_contain_text("pool:trio:rag_pipeline")
    expect(page.locator(".plot svg.main-svg").first).to_be_visible(timeout=20_000)
    expect(page.locator(".annotation-text").first).to_be_visible()  # the changes, marked
    screenshot(page, "timeline-rollout")
    assert page.console_errors == []  # type: ignore[attr-defined]
