"""An admin gives someone a role on one pool, and takes it away, on a page."""

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.models import PoolRole
from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import NodePool
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_an_admin_grants_and_revokes_a_pool_role_on_its_page(
    page: Page, live_server: object
) -> None:
    for name in ("cpu", "gpu"):
        NodePool.objects.create(name=name)
    make_user(Role.VIEWER)
    make_user(Role.ADMIN)
    base = str(live_server)
    sign_in(page, base, "admin-user")
    page.get_by_role("link", name="Pool roles").click()
    grant = page.locator("#grant")
    grant.get_by_label("User").fill("viewer-user")
    grant.get_by_label("Pool").select_option("gpu")
    grant.get_by_label("Role").select_option(label="Operator")
    grant.get_by_role("button", name="Grant").click()
    expect(page.locator(".flash")).to_have_text("viewer-user is now operator of gpu.")
    row = page.locator("#pool-roles tbody tr")
    expect(row.locator("td")).to_have_text(["gpu", "viewer-user", "Operator", "Revoke"])
    screenshot(page, "pool-roles")

    # A name that is no one's is refused where it was typed; nothing changes.
    grant.get_by_label("User").fill("viewer-usr")
    grant.get_by_role("button", name="Grant").click()
    expect(page.locator("#grant + [role=alert]")).to_have_text("no user named 'viewer-usr'")

    # By keyboard alone: Tab reaches the row's button, where the focus shows; Enter sends it.
    revoke = page.get_by_role("button", name="Revoke viewer-user's role on gpu")
    grant.get_by_role("button", name="Grant").focus()
    for _ in range(5):
        page.keyboard.press("Tab")
        if revoke.evaluate("button => button === document.activeElement"):
            break
    expect(revoke).to_be_focused()
    assert (
        revoke.evaluate("b => getComputedStyle(b).outlineStyle + getComputedStyle(b).outlineWidth")
        == "solid3px"
    )
    page.once("dialog", lambda dialog: dialog.accept())
    page.keyboard.press("Enter")
    expect(page.locator(".flash.success")).to_have_text(
        "viewer-user holds no role of their own on gpu now."
    )
    expect(row).to_have_text(
        ["No one holds a role on a single pool: everyone's own role applies everywhere."]
    )
    assert not PoolRole.objects.exists()
    events = AuditEvent.objects.filter(action="user.set_pool_role", result="ok").order_by("id")
    assert [(e.actor, e.target, e.after) for e in events] == [
        ("admin-user", "user:viewer-user", {"pool": "gpu", "role": "operator"}),
        ("admin-user", "user:viewer-user", {"pool": "gpu", "role": ""}),
    ]
    assert page.console_errors == [] or all(  # type: ignore[attr-defined]
        "422" in error
        for error in page.console_errors  # type: ignore[attr-defined]
    )
