"""A busy timeline window in a real browser: the first events, and a link to the rest."""

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.audit.services import audit_record
from apps.incidents import views
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_busy_window_shows_its_first_events_and_links_the_rest(
    page: Page, live_server: object, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    monkeypatch.setattr(views, "MAX_EVENTS", 3)  # the live server runs in this process
    monkeypatch.setattr("apps.incidents.timeline.MAX_EVENTS", 3)
    user = make_user(Role.VIEWER)
    for number in range(6):
        audit_record(actor="ops", action="node.drain", target=f"node:n{number}")
    sign_in(page, str(live_server), user.username)
    page.goto(f"{live_server}/audit/timeline/?window=1h")
    expect(page.locator("#events li")).to_have_count(3)
    notice = page.locator("#more-events")
    expect(notice).to_contain_text("more than 3 events: these are the first")
    screenshot(page, "timeline-more-events")
    seen = page.locator("#events").inner_text()
    for _ in range(5):  # page after page, to the window's end: nothing is left out
        if not notice.count():
            break
        notice.get_by_role("link", name="The rest of the window").click()
        expect(page.locator("#events li").first).to_be_visible()
        seen += page.locator("#events").inner_text()
    assert not notice.count()
    assert all(f"node:n{number}" in seen for number in range(6)), seen
    assert page.console_errors == []  # type: ignore[attr-defined]
