"""Tuning as a release in Chromium, on 3 real Triton nodes under the same load each, judged from
a real Prometheus by the real worker and beat: the reranker, one instance made slow, is named the
pipeline's bottleneck with its queue and compute times and advised more instances; accepted on
the page, the tuning rollout's page shows the pipeline serving more requests a node at no worse
P99, and says what the tuning changed and why.

The trio is behind HAProxy, and each node's users stop sending while HAProxy holds it drained,
as a balancer's would: Triton ends the canary's load (the tuned config reconfigures the version
serving as well) only once none of that version's requests is in flight, which a node kept
saturated in traffic may not allow for minutes (see the README). In `make bench` (three
saturated nodes take the machine for minutes), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_tuning_release.py -s -p no:cacheprovider`"""

import re

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.registry.models import ModelVersion
from apps.rollouts.models import Measurement, Rollout
from tests.support.browser import screenshot, sign_in
from tests.support.fleet import saturating, until_state, wait_for
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# A request spends this long in the reranker (one instance a node); every node has as many users
# as three of its full batches (8), so requests queue for two batches behind the one computing.
DELAY_MS = 100
USERS_A_NODE = 24
THROUGHPUT = "custom: rag_pipeline requests/s a node"


def test_a_slowed_step_is_named_advised_and_its_tuning_raises_throughput_at_no_worse_p99(
    trio: tuple[Devfleet, FleetState],
    haproxy: Proc,
    tuning_template: str,
    page: Page,
    live_server: object,
) -> None:
    devfleet, state = trio
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    slowest = page.locator("#slowest")

    def advised() -> bool:
        page.goto(f"{live_server}/metrics/bottleneck/rag_pipeline/?pool=trio")
        return "Advice: more instances" in (slowest.text_content() if slowest.count() else "")

    devfleet.fault("reranker", delay_ms=DELAY_MS)
    try:
        with saturating(state, per_node=USERS_A_NODE, haproxy=haproxy) as load:
            wait_for("the page names the reranker, advising more instances", advised, 90, 2)
            expect(slowest.get_by_role("heading", level=2)).to_have_text(
                "Slowest step: reranker v1"
            )
            text = slowest.text_content() or ""
            queue, compute = map(float, re.findall(r"([\d.]+) ms (?:waiting|computing)", text))
            assert queue > 2 * compute > 0, text
            slowest.get_by_text("Release it as a tuning rollout").click()
            slowest.get_by_label("Plan").fill("1 node, hold 26s\n100%")
            slowest.get_by_label("Analysis template").fill(tuning_template)
            slowest.get_by_role("button", name="Start the tuning rollout").click()
            expect(page.locator("#tuning")).to_contain_text("Tuning: reranker v1 → v")
            # Away while it runs: the page's polling would take cores from the saturated nodes.
            page.goto("about:blank")
            rollout = until_state(
                Rollout.objects.get(), Rollout.State.SUCCEEDED, Rollout.State.ROLLED_BACK
            )
            assert rollout.state == Rollout.State.SUCCEEDED, rollout.reason
        assert not [k for k in load.answered if k.endswith("failed")], load.answered
    finally:
        devfleet.fault("reranker")
    tuned = ModelVersion.objects.get(
        model__name="reranker", version=pinned_reranker_version(rollout)
    )
    assert tuned.config["instance_group"][0]["count"] >= 2
    # The evidence of the canary's step: the canary node served more requests than each
    # baseline node under the same load, at the same P99 (within a quarter: Triton's summary
    # still holds the canary's first requests, from before its instances were all busy).
    canary_step = Measurement.objects.filter(rollout=rollout, step=0).order_by("taken_at", "id")
    assert {m.verdict for m in canary_step if m.metric == THROUGHPUT} == {"success"}
    last = {m.metric: m for m in canary_step}  # each metric's last round
    assert last[THROUGHPUT].canary_value > 1.3 * last[THROUGHPUT].baseline_value
    assert last["p99"].verdict == "success"
    assert last["p99"].canary_value <= 1.25 * last["p99"].baseline_value
    # The page, opened again now that it is final, shows the same evidence, and its chart spans
    # the whole rollout.
    page.goto(f"{live_server}/rollouts/{rollout.pk}/")
    expect(page.locator("#rollout-state")).to_have_text("Succeeded")
    expect(page.locator("#chart svg.main-svg").first).to_be_visible(timeout=20_000)
    rows = page.locator("table.measurements tr", has_text="rag_pipeline requests/s a node")
    expect(rows.first.locator("td").nth(2)).to_have_text("custom rag_pipeline requests/s a node")
    expect(rows.first).to_contain_text("success")
    expect(page.locator("#tuning")).to_contain_text("whose config differs only in instance_group")
    screenshot(page, "tuning-rollout")


def pinned_reranker_version(rollout: Rollout) -> int:
    """The reranker version the rollout's pipeline version pins."""
    config = ModelVersion.objects.get(model=rollout.model, version=rollout.canary_version).config
    (pin,) = [s for s in config["ensemble_scheduling"]["step"] if s["model_name"] == "reranker"]
    return int(pin["model_version"])
