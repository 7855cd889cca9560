"""A refused click says why where it was made: htmx swaps nothing on an error by itself."""

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.accounts.services import user_ensure
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.imports import repository_import
from apps.registry.models import Model
from apps.rollouts import transitions
from apps.rollouts.models import Rollout
from tests.support.browser import screenshot, sign_in
from tests.support.users import PASSWORD, make_user

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def deploy(page: Page, label: str) -> None:
    section = page.locator("#pool-gpu")
    section.get_by_label("Deploy").select_option(label=label)
    page.once("dialog", lambda dialog: dialog.accept())
    section.get_by_role("button", name="Deploy to gpu").click()


def test_a_conflict_and_a_role_taken_away_are_said_in_place(
    page: Page, live_server: object
) -> None:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="ops")
    running = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
        state=Rollout.State.PAUSED,  # holds the model; no controller moves it meanwhile
        started_by="ops",
    )
    assert transitions.pool_claim(running, "ops") is None  # as its start claims the pool
    make_user(Role.VIEWER)
    user_ensure(username="ann", password=PASSWORD, role=Role.RELEASE_MANAGER)
    base = str(live_server)
    sign_in(page, base, "ann")
    page.goto(f"{base}/deployments/")
    deploy(page, "rag_pipeline v2")
    refusal = page.locator("#pool-gpu [role=alert]")
    expect(refusal).to_contain_text(f"rollout #{running.pk} of rag_pipeline v1 → v2 on gpu")
    expect(page).to_have_url(f"{base}/deployments/")  # nothing else moved
    screenshot(page, "refused-in-place")
    # Her role is taken away while the page is open: the next click says so, there.
    user_ensure(username="ann", password=PASSWORD, role=Role.VIEWER)
    deploy(page, "embedder v2")
    expect(refusal).to_contain_text("does not allow")
    assert not Deployment.objects.filter(created_by="ann").exists()
    assert page.console_errors == [] or all(  # type: ignore[attr-defined]
        "409" in e or "403" in e
        for e in page.console_errors  # type: ignore[attr-defined]
    )
