"""A pool's tiers page in a browser: on-call pins the tier without the reranker with a reason,
and the page says which tier serves and why. Rows are written straight to the database: no
Triton (tests/integration/test_degradation.py has the fleet)."""

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.degradation.models import Tiers
from apps.degradation.services import tiers_set
from apps.fleet.models import Deployment, Node, NodePool
from apps.registry.models import Model
from tests.support.browser import screenshot, sign_in
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_on_call_pins_a_tier_and_the_page_says_why(page: Page, live_server: object) -> None:
    import_demo()
    pool = NodePool.objects.create(name="demo")
    Node.objects.create(name="demo-1", pool=pool, http_url="http://127.0.0.1:1")
    model = Model.objects.get(name="rag_pipeline")
    Deployment.objects.create(pool=pool, model=model, version=2, created_by="ops")
    tiers_set(pool_name="demo", model_name="rag_pipeline", versions=[2, 4], actor="rm")
    said = "rag_pipeline on demo: within budget: P99 41 ms over 30 s, 38 ms over 120 s"
    probed = "probes of v2: P99 44 ms over 60 requests on demo-1, budget 250 ms"
    now = timezone.now()
    Tiers.objects.update(said=said, said_at=now, probed=probed, probed_at=now)
    sign_in(page, str(live_server), make_user(Role.OPERATOR).username)

    page.goto(f"{live_server}/deployments/")
    page.locator("#pool-demo").get_by_role("link", name="tiers").click()
    card = page.locator("#tiers-rag_pipeline")
    expect(card.get_by_role("listitem").first).to_contain_text("primary v2 serving")
    expect(card).to_contain_text(said)
    expect(card.locator("dd", has_text=probed)).to_be_visible()  # why it came back up
    expect(card.get_by_role("listitem").nth(1)).to_contain_text("v4 standing by")
    screenshot(page, "tiers-standing-by")
    card.get_by_label("Tier").select_option(label="1: v4")
    card.get_by_label("Reason").fill("reranker at 400 ms: skip it while it is looked at")
    page.once("dialog", lambda dialog: dialog.accept())
    card.get_by_role("button", name="Pin").click()
    expect(page.locator(".flash")).to_contain_text("pinned to tier 1 (v4)")
    expect(card).to_contain_text("to tier 1 by operator-user until")
    expect(card.get_by_role("listitem").nth(1)).to_contain_text("v4 serving pinned")
    screenshot(page, "tiers")
    # The pin owns what the pool serves of the pipeline: the pool's card says so.
    page.goto(f"{live_server}/deployments/")
    owners = page.locator("#pool-demo .owners")
    expect(owners).to_contain_text("Driven by: rag_pipeline: pin by operator-user until")
    expect(owners).to_contain_text("the reconciler for the rest")
    screenshot(page, "deployments-owner")
    assert page.console_errors == []  # type: ignore[attr-defined]
