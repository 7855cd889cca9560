"""The browser tests' fixtures (Playwright driving Debian chromium), for the conftest.py of
the layers that hold browser tests (tests/e2e, tests/bench): no other test imports Playwright."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, Page, expect, sync_playwright
from playwright.sync_api import Error as PlaywrightError

# Playwright's sync API runs an event loop in the test thread; Django's ORM calls in test bodies
# stay synchronous and safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

# What a page shows after a click waits on the server: a request, a redirect, the next page and
# its accessibility check. make test runs the browser tests beside the integration tests, whose
# fleets share the cores, and there 5 s (Playwright's default) is not always enough.
expect.set_options(timeout=20_000)

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is not installed: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    # Every Content Security Policy violation (inline script or style, a foreign origin) is an
    # error in the console, which the tests assert empty.
    context.add_init_script(
        "document.addEventListener('securitypolicyviolation', e => console.error("
        "'CSP violation: ' + e.violatedDirective + ' blocked ' + e.blockedURI))"
    )
    page = context.new_page()
    page.console_errors = []  # type: ignore[attr-defined]
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))  # type: ignore[attr-defined]
    barriers: list[str] = []
    page.on("load", lambda loaded: barriers.extend(accessibility_barriers(loaded)))
    yield page
    context.close()
    assert not barriers, "axe-core found serious barriers:\n" + "\n".join(barriers)


AXE = Axe()


def accessibility_barriers(page: Page) -> list[str]:
    """axe-core's serious and critical violations on the document just loaded, one line each
    (rule, what it asks, where); every page a browser test visits is checked on its load."""
    try:
        found = AXE.run(page).response["violations"]
    except PlaywrightError:
        # The page moved on while being checked: the next document is checked on its own load.
        return []
    return [
        f"{page.url}: {rule['id']} ({rule['impact']}) {rule['help']}: "
        + "; ".join(" ".join(node["target"]) for node in rule["nodes"][:5])
        for rule in found
        if rule["impact"] in ("serious", "critical")
    ]
