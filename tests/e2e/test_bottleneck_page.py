"""On-call opens where rag_pipeline's time goes from its model page: the step that queues is named
first, with the numbers behind it and its advice; steps and GPUs below."""

import time

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Deployment, NodePool
from apps.registry.models import Model, ModelVersion
from tests.support.backfill import backfilled_prometheus, pipeline_steps
from tests.support.browser import screenshot, sign_in
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_bottleneck_is_named_with_its_evidence_and_advice(
    page: Page, live_server: object, settings: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    Deployment.objects.create(pool=pool, model=Model.objects.get(name="rag_pipeline"), version=1)
    make_user(Role.VIEWER)
    now = int(time.time())
    text = pipeline_steps(range(now - 900, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("bottleneck"), text) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        sign_in(page, str(live_server), "viewer-user")
        page.goto(f"{live_server}/models/rag_pipeline/")
        page.get_by_role(
            "link", name="Where its time goes, step by step, and what to change"
        ).click()
        slowest = page.locator("#slowest")
        expect(slowest.get_by_role("heading", level=2)).to_have_text("Slowest step: reranker v1")
        expect(slowest).to_contain_text("40.0 ms waiting in its queue, 10.0 ms computing")
        expect(slowest.get_by_role("heading", level=3)).to_have_text(
            "Advice: more instances: 1 -> 2"
        )
        rows = page.locator("#steps tbody tr")
        expect(rows).to_have_count(4)
        expect(rows.nth(2)).to_contain_text("reranker v1 slowest")
        expect(page.get_by_text("The pool's GPUs: 30% busy on average")).to_be_visible()
        screenshot(page, "bottleneck")

        # What the reranker's requests cost its GPUs, over time: where a tuning release shows
        # what it saved.
        page.goto(f"{live_server}/metrics/?metric=cost&model=reranker&pool=gpu&range=15m")
        chart = page.locator("#chart")
        expect(chart.locator("svg.main-svg").first).to_be_visible(timeout=20_000)
        expect(chart).to_contain_text("Compute per 1,000 requests")
        screenshot(page, "metrics-cost")
