"""On-call and the release manager see an LLM step as users feel it: its time to first token
charted from a vLLM backend's series (backfilled into a real Prometheus), and a release whose
longest answer would not fit its budget warned of on the rollout form with the figures."""

import time

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from tests.support.backfill import backfilled_prometheus, llm_series
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_time_to_first_token_is_charted_and_a_longest_answer_over_budget_is_warned_of(
    page: Page, live_server: object, settings: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = Model.objects.create(name="generator", latency_budget_ms=2000)
    for version in (3, 4):
        config: dict[str, object] = {"name": "generator", "backend": "python"}
        if version == 4:  # answers with up to 400 tokens, at 20 ms each on this pool
            config["parameters"] = {"max_tokens": {"string_value": "400"}}
        ModelVersion.objects.create(
            model=model, version=version, config=config, status=ModelVersion.Status.PUBLISHED
        )
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2"):
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    deployment_set(model_name="generator", version=3, pool=pool, actor="ops")
    make_user(Role.RELEASE_MANAGER)
    now = int(time.time())
    text = llm_series(range(now - 1200, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("llm"), text) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        sign_in(page, str(live_server), "release_manager-user")
        page.goto(f"{live_server}/metrics/?metric=ttft_p99&model=generator&pool=gpu&range=15m")
        chart = page.locator("#chart")
        expect(chart.locator("svg.main-svg").first).to_be_visible()
        expect(chart).to_contain_text("Time to first token, P99")
        expect(chart).to_contain_text("generator v3")
        screenshot(page, "metrics-ttft")

        page.goto(f"{live_server}/rollouts/new/?model=generator&pool=gpu")
        page.get_by_label("Canary version").select_option("4")
        page.get_by_label("Plan").fill("100%")
        page.get_by_role("button", name="Preview").click()
        budget = page.locator("#llm-budget")
        expect(budget).to_contain_text("LLM budget not shown to fit")
        expect(budget).to_contain_text(
            "generator v4 (max_tokens 400): first token 298 ms (P99) + 400 tokens x 20.0 ms = "
            "8298 ms, over its budget of 2000 ms"
        )
        screenshot(page, "rollout-llm-budget")
    assert page.console_errors == []  # type: ignore[attr-defined]
