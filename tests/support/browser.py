"""Browser steps the end-to-end tests share (the browser and page fixtures are in conftest.py)."""

import re
from pathlib import Path

from playwright.sync_api import Page, expect

from tests.support import ROOT
from tests.support.users import PASSWORD

SCREENSHOTS = ROOT / "var" / "screenshots"


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=path, full_page=True)
    return path


def sign_in(page: Page, base: str, username: str) -> None:
    page.goto(base + "/nodes/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/nodes/"))
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(base + "/nodes/")
