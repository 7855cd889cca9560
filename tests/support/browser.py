"""Browser steps the end-to-end tests share (the browser and page fixtures are in conftest.py)."""

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Page, expect

from tests.support import ROOT
from tests.support.users import PASSWORD

SCREENSHOTS = ROOT / "var" / "screenshots"
# The README's pictures, by the screenshot each one is: `make screenshots` runs the tests that
# take them and copies them here, so the README shows the pages as they are today.
README_PICTURES = {"nodes": "nodes", "registry-version": "pipeline", "metrics-p99": "metrics"}
README_SCREENSHOTS = ROOT / "deploy" / "screenshots"


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=path, full_page=True)
    if os.environ.get("README_SCREENSHOTS") and name in README_PICTURES:
        shutil.copyfile(path, README_SCREENSHOTS / f"{README_PICTURES[name]}.png")
    return path


@contextmanager
def dark(page: Page) -> Iterator[None]:
    """The page reloaded in the dark theme, as a system that prefers it shows it (and checked by
    axe-core on that load like any page: its contrast too); the light theme again after."""
    page.emulate_media(color_scheme="dark")
    page.reload()
    yield
    page.emulate_media(color_scheme="light")


def sign_in(page: Page, base: str, username: str) -> None:
    page.goto(base + "/nodes/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/nodes/"))
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(base + "/nodes/")
