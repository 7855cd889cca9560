"""The Metrics page in Chromium over real Triton nodes, real traffic and a real Prometheus."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.audit.services import audit_record
from apps.devtools.traffic import send_traffic
from apps.fleet.services.nodes import node_register
from apps.fleet.triton import TritonClient
from apps.observability.markers import SAME_TICK
from apps.registry.imports import repository_import
from tests.support import REPOSITORY
from tests.support.browser import dark, screenshot, sign_in
from tests.support.fleet import Fleet
from tests.support.services import Celery
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_p99_chart_draws_redraws_and_marks_a_deployment_made_in_the_product(
    fleet: Fleet,
    clients: list[TritonClient],
    celery: Celery,
    page: Page,
    live_server: object,
    settings: object,
) -> None:
    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    for proc in fleet.state.nodes:
        node_register(name=proc.name, pool="it", actor="system:test", **fleet.state.node_urls(proc))
    # Real traffic all through the test, so the P99 summary has observations in every window.
    traffic = threading.Thread(
        target=send_traffic,
        args=(clients,),
        kwargs={"model": "rag_pipeline", "rps": 10, "seconds": 40},
    )
    began = timezone.now()
    traffic.start()
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)

    page.goto(f"{live_server}/deployments/")
    pool = page.locator("#pool-it")
    pool.get_by_label("Deploy").select_option(label="rag_pipeline v1")
    page.once("dialog", lambda dialog: dialog.accept())
    pool.get_by_role("button", name="Deploy to it").click()
    expect(page.locator(".flash")).to_contain_text("rag_pipeline v1")

    page.goto(f"{live_server}/metrics/?metric=p99&model=rag_pipeline&range=15m")
    chart = page.locator("#chart")
    expect(chart.locator("svg.main-svg").first).to_be_visible(timeout=20_000)
    expect(chart.locator("g.legend")).to_contain_text("rag_pipeline v1")
    expect(chart.locator(".annotation-text", has_text="deploy rag_pipeline v1")).to_have_count(1)
    drawn = chart.locator(".plot").element_handle()
    page.get_by_label("Range").select_option("1h")
    page.wait_for_function("el => !el.isConnected", arg=drawn)  # the old figure was swapped out
    expect(chart.locator("svg.main-svg").first).to_be_visible(timeout=20_000)
    page.get_by_label("Auto-refresh").check()
    expect(chart).to_have_attribute("hx-trigger", "every 15s")
    expect(chart.locator("svg.main-svg").first).to_be_visible(timeout=20_000)
    screenshot(page, "metrics-p99-1h")

    page.goto(f"{live_server}/")
    tiles = page.locator("#live-tiles")
    expect(tiles).to_contain_text("req/s", timeout=20_000)
    expect(tiles).to_contain_text("budget")
    screenshot(page, "overview")
    with dark(page):
        expect(tiles).to_contain_text("req/s", timeout=20_000)
        screenshot(page, "overview-dark")
    traffic.join()

    # The whole traffic, every step of the pipeline, in a custom window around it.
    window = f"start={began:%Y-%m-%dT%H:%M:%S}&end={timezone.now():%Y-%m-%dT%H:%M:%S}"
    page.goto(f"{live_server}/metrics/?metric=p99&range=custom&{window}")
    expect(chart.locator("g.legend")).to_contain_text("reranker v1", timeout=20_000)
    screenshot(page, "metrics-p99")

    # The degradation automation's switches, as it records them (tests/integration/
    # test_degradation.py makes real ones), on the pipeline's P99 chart: two markers, apart.
    switch("pool.degrade", 1, 4, "P99 412 ms over 30 s and 398 ms over 120 s, budget 250 ms")
    time.sleep(SAME_TICK.total_seconds())  # within one tick, two changes read as one
    switch("pool.restore", 4, 1, "probes of v1: P99 41 ms over 40 requests on it-1, it-2")
    end = timezone.now() + timedelta(seconds=1)  # the form's whole seconds: past the switch
    window = f"start={began:%Y-%m-%dT%H:%M:%S}&end={end:%Y-%m-%dT%H:%M:%S}"
    page.goto(f"{live_server}/metrics/?metric=p99&model=rag_pipeline&range=custom&{window}")
    for label in ("step down rag_pipeline v4", "step back up rag_pipeline v1"):
        expect(chart.locator(".annotation-text", has_text=label)).to_have_count(1)
    screenshot(page, "degradation-switches")
    assert page.console_errors == []  # type: ignore[attr-defined]


def switch(action: str, serving: int, to: int, evidence: str) -> None:
    with transaction.atomic():
        audit_record(
            actor="system:degradation",
            action=action,
            target="pool:it:rag_pipeline",
            before={"version": serving},
            after={"version": to},
            message=evidence,
        )
