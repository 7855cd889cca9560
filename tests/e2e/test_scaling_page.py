"""A pool's scaling page in a browser: the nodes it wants and why, held by a running rollout,
the nodes a scale-in takes first; on-call pins it with a reason. Rows are written straight to
the database: no Prometheus (tests/integration/test_scaling.py reads a real one)."""

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.scaling.models import Scaling
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REASONS = [
    "load: rag_pipeline v3 12.0/s of 10.0 a node (run 7), at 80% of capacity: 2 nodes",
    "queue: reranker waits 0.20x its compute time on 3 nodes in traffic (target 1x): 1 node",
    "held at its 4 nodes, not 2: rollout 1 (canary) of rag_pipeline v3 runs (no scale-in)",
]


def test_on_call_reads_why_the_pool_holds_its_nodes_and_pins_it(
    page: Page, live_server: object
) -> None:
    pool = NodePool.objects.create(name="demo")
    for i in range(1, 5):
        Node.objects.create(name=f"demo-{i}", pool=pool, http_url="http://127.0.0.1:1")
    Node.objects.filter(name="demo-4").update(draining=True)
    Rollout.objects.create(
        model=Model.objects.create(name="rag_pipeline"),
        pool=pool,
        baseline_version=2,
        canary_version=3,
        plan=[{"nodes": 1}, {"percent": 100}],
        state=Rollout.State.PROGRESSING,
        canary_nodes=["demo-3"],
        started_by="ann",
    )
    held = "rollout 1 (canary) of rag_pipeline v3 runs"
    Scaling.objects.create(
        pool=pool, wanted=4, nodes=4, reasons=REASONS, held=held, computed_at=timezone.now()
    )
    sign_in(page, str(live_server), make_user(Role.OPERATOR).username)

    page.goto(f"{live_server}/deployments/")
    page.locator("#pool-demo").get_by_role("link", name="scaling").click()
    signal = page.locator("#signal")
    expect(signal.get_by_role("heading").first).to_contain_text("4 nodes wanted held: no scale-in")
    expect(signal).to_contain_text("4 nodes, 3 in traffic")
    for reason in REASONS:
        expect(signal.get_by_role("listitem").filter(has_text=reason)).to_be_visible()
    first = page.locator("#scale-in li")
    expect(first).to_have_count(3)  # never the canary
    expect(first.first).to_contain_text("demo-4 out of traffic")
    expect(page.locator("#scale-in")).not_to_contain_text("demo-3")
    screenshot(page, "scaling")

    pin = page.locator("#pin")
    pin.get_by_label("Nodes").fill("6")
    pin.get_by_label("Reason").fill("launch tonight: hold six until 02:00")
    page.once("dialog", lambda dialog: dialog.accept())
    pin.get_by_role("button", name="Pin").click()
    expect(page.locator(".flash")).to_contain_text("pool demo: pinned at 6 nodes")
    expect(signal.get_by_role("heading").first).to_contain_text("6 nodes wanted pinned")
    expect(signal).to_contain_text("at 6 by operator-user: launch tonight: hold six until 02:00")
    expect(page.locator("#bounds")).to_have_count(0)  # an operator's page: no bounds form
    screenshot(page, "scaling-pinned")
    assert page.console_errors == []  # type: ignore[attr-defined]
