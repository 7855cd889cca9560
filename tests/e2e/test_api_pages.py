import re

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.models import ApiToken
from apps.accounts.roles import Role
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_user_creates_a_token_sees_it_once_revokes_it_and_reads_the_api_docs(
    page: Page, live_server: object
) -> None:
    user = make_user(Role.RELEASE_MANAGER)
    sign_in(page, str(live_server), user.username)
    page.get_by_role("link", name=user.username).click()
    expect(page.get_by_role("heading", name=re.compile("API tokens"))).to_be_visible()
    page.get_by_label("Name").fill("release pipeline")
    page.get_by_role("button", name="Create token").click()
    shown = page.locator("#new-token code.token")
    expect(shown).to_have_text(re.compile(r"^tcp_\S{40,}$"))
    screenshot(page, "api-token-created")
    value = shown.inner_text()
    assert ApiToken.objects.get().prefix == value[:10]
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Revoke").click()
    expect(page.locator("#tokens")).to_contain_text("revoked")
    expect(page.locator("#new-token")).to_have_count(0)
    assert ApiToken.objects.get().revoked_at is not None
    page.get_by_role("link", name="API").click()
    # The docs say "loading" until Swagger's bundle has loaded and run (the schema itself builds
    # in 0.2 s): on a busy 2-core CI machine that took more than the default 5 s.
    title = page.locator(".swagger-ui .info .title")
    expect(title).to_contain_text("Triton control plane", timeout=30_000)
    expect(page.get_by_text("/api/rollouts", exact=True).first).to_be_visible()
    screenshot(page, "api-docs")
    assert page.console_errors == []  # type: ignore[attr-defined]
