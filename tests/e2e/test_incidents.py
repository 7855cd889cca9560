"""An alert-driven incident, end to end and nothing stubbed: a real Prometheus rule over the real
Triton nodes' P99 fires on a real slow release (the demo's v3), a real Alertmanager posts it to
the receiver, the incident opens with that rollout ranked first among its suspects, one click in
the browser rolls it back, the alert resolves and the incident follows."""

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import pytest
import requests
from django.test import Client
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.accounts.services import token_create
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.incidents.models import Incident
from apps.incidents.suspects import suspects
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from tests.support.browser import dark, screenshot, sign_in
from tests.support.fleet import ANALYSIS, ready_on, wait_for
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

BUDGET_MS = 200  # v1 answers in a few ms here; v3's reranker sleeps 250 ms on every batch
RULES = {
    "groups": [
        {
            "name": "incident-test",
            "interval": "1s",
            "rules": [
                {
                    "alert": "RagPipelineSlow",
                    "expr": "max by (pool, model) (nv_inference_request_summary_us"
                    f'{{quantile="0.99",model="rag_pipeline"}}) / 1000 > {BUDGET_MS}',
                    "for": "2s",
                    "labels": {"severity": "critical"},
                    "annotations": {
                        "summary": "P99 of {{ $labels.model }} in pool {{ $labels.pool }} "
                        "over its budget"
                    },
                }
            ],
        }
    ]
}


def _get(url: str) -> dict:
    return requests.get(url, timeout=2).json()


@contextmanager
def alerting(devfleet: Devfleet, state: FleetState, receiver: str, token: str) -> Iterator[None]:
    """A real Alertmanager posting to `receiver`, and the fleet's Prometheus evaluating RULES and
    sending to it; Prometheus back to scraping only afterwards."""
    rules = devfleet.home / "incident-rules.yml"
    rules.write_text(json.dumps(RULES))  # JSON is valid YAML
    try:
        devfleet.alerting(receiver=receiver, token=token, rules=rules)
        loaded = f"{state.prometheus_url}/api/v1/rules"
        wait_for("Prometheus has the rule", lambda: "RagPipelineSlow" in json.dumps(_get(loaded)))
        yield
    finally:
        devfleet.alerting_stop()


def worst_p99(state: FleetState, *, over: str) -> float:
    """The highest P99 (ms) the rule compared with its threshold over the last `over`; infinite
    until the series holds the whole of `over` (a series a few seconds old has been under the
    budget for those seconds only, and leaves the suspects nothing to compare v3 with)."""
    expression = RULES["groups"][0]["rules"][0]["expr"].rpartition(" > ")[0]  # type: ignore[index]
    seconds = int(over.removesuffix("m")) * 60
    query = (
        f"max(max_over_time(({expression})[{over}:1s]))"
        f" and on() (min(count_over_time(({expression})[{over}:1s])) >= {seconds - 5})"
    )
    found = _get(f"{state.prometheus_url}/api/v1/query?query={quote(query)}")
    return max((float(row["value"][1]) for row in found["data"]["result"]), default=math.inf)


def test_an_alert_opens_an_incident_whose_first_suspect_is_rolled_back_in_one_click(
    serving_v1: NodePool,
    traffic: None,
    trio: tuple[Devfleet, FleetState],
    live_server: object,
    page: Page,
    client: Client,
) -> None:
    devfleet, state = trio
    on_call = make_user(Role.OPERATOR)
    _, token = token_create(user=on_call, name="alertmanager", actor="system:test")
    # v1's first requests (a cold start) stay in Triton's P99 summary for a while: the rule
    # would fire on them, and they would be what v3 is compared with. It must fire on v3.
    wait_for(
        "v1's P99 has been under the budget for a minute",
        lambda: worst_p99(state, over="1m") < BUDGET_MS,
        300,
    )
    with alerting(devfleet, state, f"{live_server}/api/alertmanager", token):
        # A judge that lets the slow canary stay: the alert, not the rollout, is under test.
        rollout = rollout_start(
            model_name="rag_pipeline",
            pool_name=serving_v1.name,
            canary_version=3,
            plan="1 node, hold 10m\n100%",
            analysis={**ANALYSIS, "p99_margin_ms": 60000},
            actor="release-manager",
        )
        wait_for("the alert opened an incident", Incident.objects.exists, 180)
        incident = Incident.objects.get()
        assert (incident.pool, incident.model.name) == (serving_v1, "rag_pipeline")  # type: ignore[union-attr]
        ranked, problem = suspects(incident)
        assert problem == "" and ranked[0].title.startswith(f"rollout #{rollout.pk}:")
        assert ranked[0].p99 is not None and ranked[0].p99[1] > ranked[0].p99[0]

        sign_in(page, str(live_server), on_call.username)
        page.goto(f"{live_server}/incidents/{incident.pk}/")
        first = page.locator("#suspects tr.suspect").first
        expect(first).to_contain_text(f"rollout #{rollout.pk}: rag_pipeline v1 → v3 on trio")
        expect(page.locator("#evidence .js-plotly-plot")).to_be_visible(timeout=20000)
        screenshot(page, "incident")
        with dark(page):
            expect(page.locator("#evidence .js-plotly-plot")).to_be_visible(timeout=20000)
            screenshot(page, "incident-dark")
        page.once("dialog", lambda dialog: dialog.accept())
        first.get_by_role("button", name="Roll back rag_pipeline on trio").click()
        expect(page.locator(".flash")).to_contain_text(
            f"Rollout #{rollout.pk} is rolling back to v1"
        )
        assert page.console_errors == []  # type: ignore[attr-defined]

        canary = Rollout.objects.get(pk=rollout.pk).canary_nodes[0]
        node = serving_v1.nodes.get(name=canary)
        wait_for(
            "the canary serves v1 only",
            lambda: {1} == {v for m, v in ready_on(node) if m == "rag_pipeline"},
        )
        wait_for(
            "the alert resolved and the incident followed",
            lambda: Incident.objects.get().status == Incident.Status.RESOLVED,
            240,
        )
    page.goto(f"{live_server}/incidents/")
    expect(page.locator("#incidents")).to_contain_text("resolved")
    screenshot(page, "incidents")
    page.goto(f"{live_server}/incidents/{incident.pk}/")
    expect(page.locator("#actions")).to_contain_text("incident.resolve")
    screenshot(page, "incident-resolved")
    assert page.console_errors == []  # type: ignore[attr-defined]
    client.force_login(on_call)
    report = client.get(f"/incidents/{incident.pk}/report.md").content.decode()
    done = [f"| {on_call.username} | `incident.{a}` |" for a in ("open", "rollback", "resolve")]
    order = ["# Incident #", "## Suspect changes", f"1. **rollout #{rollout.pk}:", *done]
    assert all(s in report for s in order), report
    assert [report.index(s) for s in order] == sorted(report.index(s) for s in order), report
    assert re.search(r"Time to resolve: \d+ (min \d+ )?s", report), report
