"""A pool behind a real HAProxy, in Chromium: a 10 % rollout's page shows the share intended and
the one observed in Prometheus, then the statistical judge's evidence (both sides' samples), and
the canary node's page its weight as HAProxy shows it."""

import re

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from apps.rollouts.proposals import rollout_start
from tests.support.browser import screenshot, sign_in
from tests.support.fleet import ANALYSIS, traffic_to
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
JUDGED = {"judge": "statistical", "sample_s": 4, "window_s": 20}


def test_a_weighted_rollout_shows_its_share_and_its_canary_node_the_weight(
    weighted: NodePool,
    haproxy: Proc,
    trio: tuple[object, FleetState],
    page: Page,
    live_server: object,
) -> None:
    through = f"http://127.0.0.1:{haproxy.ports['http']}"
    with traffic_to(trio[1], through=through, rps=10):
        rollout = rollout_start(
            model_name="rag_pipeline",
            pool_name=weighted.name,
            canary_version=2,
            plan="10%, hold 10m\n100%",
            # 10 % of 10 requests a second: 4 s samples over 20 s give the canary 5 of its own.
            analysis={**ANALYSIS, **JUDGED, "failure_limit": 100},
            actor="release-manager",
        )
        sign_in(page, str(live_server), make_user(Role.VIEWER).username)
        page.goto(f"{live_server}/rollouts/{rollout.pk}/")
        share = page.locator(".share")
        expect(share).to_contain_text("intended 10% (weighted)", timeout=30_000)
        expect(share).to_contain_text(re.compile(r"observed \d+\.\d%"), timeout=90_000)
        screenshot(page, "rollout-weighted")
        evidence = page.locator(".evidence .plot svg.main-svg").first
        expect(evidence).to_be_visible(timeout=90_000)
        expect(page.locator(".evidence")).to_contain_text(re.compile(r"p = [0-9.e-]+"))
        page.locator(".evidence").scroll_into_view_if_needed()
        screenshot(page, "rollout-evidence")
        page.goto(f"{live_server}/nodes/trio-1/")
        traffic = page.locator(".traffic")
        expect(traffic).to_contain_text("weight 22 · HAProxy shows 22", timeout=90_000)
        screenshot(page, "node-traffic")
    assert page.console_errors == []  # type: ignore[attr-defined]
