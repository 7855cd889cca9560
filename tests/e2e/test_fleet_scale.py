"""The fleet pages at 500 nodes, in Chromium: filter, search, next page, drill-down."""

import re

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.devtools.seed import Size, seed_fleet
from apps.fleet.desired import fleet_desired
from apps.fleet.discovery import nodes_sync
from apps.fleet.memory import capacity
from apps.fleet.models import Footprint, Node, NodePool
from apps.registry.models import ModelVersion
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_nodes_page_stays_usable_at_500_nodes(page: Page, live_server: object) -> None:
    seed_fleet(size=Size(nodes=500, operations=500, rollouts=4, events=500))
    user = make_user(Role.VIEWER)
    sign_in(page, str(live_server), user.username)
    page.goto(f"{live_server}/")
    pools = page.locator("#pools tbody tr")
    expect(pools).to_have_count(10)
    screenshot(page, "overview-500")
    # Drill down from a pool's drifting nodes to the nodes page, filtered.
    # pool-00's canary nodes serve the baseline only, not the canary beside it.
    pools.first.get_by_role("link", name="40 / 50").click()
    expect(page.locator("#node-summary")).to_contain_text(
        "10 nodes match: 10 ready, 0 unreachable, 10 drifting"
    )
    page.goto(f"{live_server}/nodes/")
    expect(page.locator("#node-summary")).to_contain_text("500 nodes: 494 ready, 6 unreachable")
    expect(page.locator("#node-table tbody tr")).to_have_count(50)
    page.get_by_role("link", name="Next").click()
    expect(page.locator("#node-summary")).to_contain_text("Showing 51\u2013100")
    expect(page.locator("#node-table tbody tr").first).to_contain_text("node-0001")
    page.get_by_label("Pool").select_option("pool-03")
    page.get_by_label("Health").select_option("unreachable")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#node-table tbody tr")).to_have_count(1)
    expect(page.locator("#node-table tbody tr")).to_contain_text("node-0393")
    page.get_by_label("Search").fill("node-012")
    page.get_by_label("Health").select_option("")
    page.get_by_label("Pool").select_option("")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#node-table tbody tr")).to_have_count(10)
    screenshot(page, "nodes-500-search")
    assert not page.console_errors  # type: ignore[attr-defined]


def test_an_operator_adopts_a_model_someone_else_loaded(page: Page, live_server: object) -> None:
    seed_fleet(size=Size(nodes=3, pools=1, models=5, versions=2, operations=3, events=3))
    node = Node.objects.get(name="node-0001")
    hand = {"model": "hand-loaded", "version": "1", "state": "READY", "reason": ""}
    Node.objects.filter(pk=node.pk).update(index=[*node.index, hand])
    sign_in(page, str(live_server), make_user(Role.OPERATOR).username)
    page.goto(f"{live_server}/nodes/node-0001/")
    row = page.locator("#model-hand-loaded")
    expect(row).to_contain_text("unmanaged")
    expect(row.get_by_role("button", name="Unload")).to_have_count(0)
    screenshot(page, "node-unmanaged")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    row.get_by_role("button", name="Adopt").click()
    expect(page.locator(".flash")).to_contain_text("hand-loaded on node-0001 is managed now")
    assert asked and "the reconciler unloads it unless a deployment names it" in asked[0]
    expect(page.locator("#model-hand-loaded")).not_to_contain_text("unmanaged")
    expect(page.locator("#model-hand-loaded").get_by_role("button", name="Unload")).to_be_visible()
    assert "hand-loaded" in Node.objects.get(pk=node.pk).owned


def test_a_pools_capacity_page_warns_of_what_will_not_fit(page: Page, live_server: object) -> None:
    seed_fleet(size=Size(nodes=60, pools=1, models=5, versions=2, operations=5, events=5))
    versions = ModelVersion.objects.values_list("model__name", "version")
    Footprint.objects.bulk_create(
        Footprint(model_name=m, version=v, device="cpu", mb=100 + v, samples=2) for m, v in versions
    )
    Node.objects.update(memory_limit_mb=100_000)
    pool = NodePool.objects.get()
    rows = capacity(list(pool.nodes.order_by("name")), fleet_desired(pool_ids=[pool.pk]))
    tight = next(row for row in rows if row.pending)  # a drifting node, a version still to load
    taken = sum(mb for _, mb in tight.room.taken)
    # Too little even once what it switches from is unloaded first.
    Node.objects.filter(pk=tight.node.pk).update(memory_limit_mb=max(1, round(taken) - 50))
    sign_in(page, str(live_server), make_user(Role.VIEWER).username)
    page.goto(f"{live_server}/deployments/")
    page.locator(f"#pool-{pool.name}").get_by_role("link", name="memory").click()
    expect(page.get_by_role("heading", name=f"Capacity of pool {pool.name}")).to_be_visible()
    expect(page.locator("#throughput")).to_contain_text("not measured yet")  # its releases
    expect(page.locator("#short")).to_contain_text(f"{tight.node.name} needs")
    expect(page.locator("#capacity tbody tr")).to_have_count(50)
    expect(page.locator(f"#capacity-{tight.node.name}")).to_contain_text("does not fit")
    screenshot(page, "pool-capacity")
    page.get_by_role("link", name="Next").click()
    expect(page.locator("#capacity tbody tr")).to_have_count(10)
    assert not page.console_errors  # type: ignore[attr-defined]


def test_the_deploy_form_warns_before_a_release_that_will_not_fit_is_sent(
    page: Page, live_server: object
) -> None:
    seed_fleet(size=Size(nodes=8, pools=1, models=3, versions=2, operations=3, events=3))
    pool = NodePool.objects.get()
    # The pool runs v2 of each model; going back to model-001 v1 takes 50 GB.
    ModelVersion.objects.filter(model__name="model-001", version=1).update(memory_mb=50_000)
    ModelVersion.objects.filter(model__name="model-000").update(memory_mb=10)
    Node.objects.filter(name__in=["node-0001", "node-0002"]).update(memory_limit_mb=8_000)
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    page.goto(f"{live_server}/deployments/")
    section = page.locator(f"#pool-{pool.name}")
    choose = section.get_by_label("Deploy")
    choose.select_option("model-001:1")
    warning = section.locator(f"#fit-{pool.name} [role=alert]")
    expect(warning).to_contain_text("Will not fit beside what they serve: node-0001 needs 55")
    expect(warning).to_contain_text("with headroom for model-001 v1")
    expect(warning).to_contain_text("node-0002 needs")
    expect(warning.get_by_role("link", name=f"memory of pool {pool.name}")).to_be_visible()
    screenshot(page, "deploy-fit-warning")
    choose.select_option("model-000:2")  # what the pool runs
    expect(section.locator(f"#fit-{pool.name} [role=alert]")).to_have_count(0)
    assert not page.console_errors  # type: ignore[attr-defined]


def test_the_nodes_page_shows_nodes_joining_serving_quarantined_and_departed(
    page: Page, live_server: object
) -> None:
    """Nodes found by discovery beside seeded ones: one still joining, one whose load hung,
    one departed."""
    seed_fleet(size=Size(nodes=3, pools=1, models=5, versions=2, operations=3, events=3))
    listed = [
        {
            "labels": {"node": name, "pool": "pool-00"},
            "scrapeUrl": f"http://10.0.3.{i}:8002/metrics",
        }
        for i, name in enumerate(["gpu-new", "gpu-gone", "gpu-hung"], start=1)
    ]
    NodePool.objects.filter(name="pool-00").update(discoverable=True)
    nodes_sync(listed, timezone.now())
    Node.objects.filter(name="gpu-gone").update(stage=Node.Stage.DEPARTED, health="unreachable")
    hung = "model-000 v2 still LOADING 120 s after its load was sent, and not ready"
    Node.objects.filter(name="gpu-hung").update(
        stage=Node.Stage.QUARANTINED, health="ready", stage_reason=hung
    )
    sign_in(page, str(live_server), make_user(Role.VIEWER).username)
    page.goto(f"{live_server}/nodes/")
    expect(page.locator("#node-summary")).to_contain_text("1 joining, 1 quarantined; 1 departed")
    expect(page.locator("#node-gpu-hung .badge.stage-quarantined")).to_have_attribute(
        "title", re.compile(r"^model-000 v2 still LOADING")
    )
    expect(page.locator("#node-gpu-new")).to_contain_text("joining 0 of 4 models READY")
    expect(page.locator("#node-gpu-gone")).to_contain_text("departed")
    expect(page.locator("#node-node-0001 .badge.stage-joining")).to_have_count(0)
    screenshot(page, "nodes-stages")
    page.get_by_label("Stage").select_option("joining")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#node-table tbody tr")).to_have_count(1)
    expect(page.locator("#node-table tbody tr")).to_contain_text("gpu-new")
    page.goto(f"{live_server}/nodes/gpu-hung/")
    expect(page.get_by_role("alert")).to_contain_text("Quarantined")
    expect(page.get_by_role("alert")).to_contain_text("model-000 v2 still LOADING")
    screenshot(page, "node-quarantined")
    assert not page.console_errors  # type: ignore[attr-defined]
