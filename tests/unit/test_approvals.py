"""Two people for a protected pool: a person's deployment, promotion or pool-wide rollback there
waits for someone else with the release manager role on the pool, and expires unapproved."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.accounts.services import user_ensure
from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, NodePool
from apps.fleet.services import deployment_set, pool_role_set
from apps.registry.models import ModelVersion
from apps.rollouts.approvals import ApprovalError, approval_approve, approval_request
from apps.rollouts.models import Approval, Rollout
from apps.rollouts.services import release_rollback, rollout_promote
from tests.support.registry import import_demo
from tests.support.users import PASSWORD, bearer, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool() -> NodePool:
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.RELEASED)
    pool = NodePool.objects.create(name="gpu")
    deployment_set(model_name="embedder", version=1, pool=pool, actor="system:test")
    call_command("set_pool_protected", "gpu", "on", stdout=None)
    pool.refresh_from_db()
    return pool


def person(name: str, role: Role = Role.RELEASE_MANAGER) -> User:
    make_user(Role.VIEWER)  # the role groups
    return user_ensure(username=name, password=PASSWORD, role=role)


def deployed(pool: NodePool) -> int:
    return Deployment.objects.get(pool=pool, model__name="embedder").version


def test_a_deployment_waits_for_a_second_person(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    page = Client()
    page.force_login(ann)
    response = page.post("/deployments/gpu/", {"model_version": "embedder:2"})
    assert response.status_code == 302 and response["Location"] == "/rollouts/approvals/"
    assert deployed(pool) == 1  # nothing changed yet
    approval = Approval.objects.get()
    assert (approval.action, approval.params, approval.requested_by) == (
        "deployment.set",
        {"pool": "gpu", "model": "embedder", "version": 2, "baseline": None},
        ann,
    )
    listing = page.get("/rollouts/approvals/").content.decode()
    assert "is request #" in listing and "waiting for a second person" in listing
    assert "Approve</button>" not in listing  # not to its own requester
    with pytest.raises(ApprovalError, match="you cannot approve your own"):
        approval_approve(approval_id=approval.pk, actor=ann)
    page.force_login(bob)
    assert "Approve</button>" in page.get("/rollouts/approvals/").content.decode()
    page.post(f"/rollouts/approvals/{approval.pk}/approve/")
    assert deployed(pool) == 2
    approval.refresh_from_db()
    assert (approval.status, approval.approved_by) == ("approved", bob)
    done = AuditEvent.objects.get(action="approval.approve", result="ok")
    assert done.actor == "bob" and done.after["requested_by"] == "ann"
    assert [part["action"] for part in done.after["parts"]] == ["deployment.set"]
    assert Deployment.objects.get(pool=pool).created_by == "ann"  # carried out as hers
    denied = AuditEvent.objects.get(action="deployment.set", result="denied")
    assert denied.actor == "ann" and "pool gpu is protected" in denied.message


def test_an_approval_expires(pool: NodePool, settings: object) -> None:
    ann, bob = person("ann"), person("bob")
    with pytest.raises(ApprovalRequired) as refused:
        deployment_set(model_name="embedder", version=2, pool=pool, actor=ann)
    approval = approval_request(refused=refused.value, actor=ann)
    Approval.objects.filter(pk=approval.pk).update(expires_at=timezone.now() - timedelta(1))
    with pytest.raises(ApprovalError, match=rf"approval #{approval.pk} expired"):
        approval_approve(approval_id=approval.pk, actor=bob)
    assert deployed(pool) == 1


def test_only_a_release_manager_of_that_pool_approves(pool: NodePool) -> None:
    ann = person("ann")
    carl = person("carl", Role.VIEWER)
    NodePool.objects.create(name="cpu")
    pool_role_set(username="carl", pool_name="cpu", role="release_manager", actor="ops")
    client = Client()
    client.force_login(ann)
    client.post("/deployments/gpu/", {"model_version": "embedder:2"})
    approval = Approval.objects.get()
    client.force_login(carl)  # a release manager, of another pool
    assert client.post(f"/rollouts/approvals/{approval.pk}/approve/").status_code == 403
    assert Approval.objects.get().status == "pending" and deployed(pool) == 1


def test_through_the_api_a_change_answers_202_and_is_approved_there(
    client: Client, pool: NodePool
) -> None:
    ann, bob = person("ann"), person("bob")
    body = {"model": "embedder", "version": 2, "pool": "gpu"}
    waiting = client.post("/api/deployments", body, "application/json", headers=bearer(ann))
    assert waiting.status_code == 202
    number = waiting.json()["approval"]
    assert f"POST /api/approvals/{number}/approve" in waiting.json()["message"]
    listed = client.get("/api/approvals", headers=bearer(bob)).json()
    assert [(a["id"], a["status"], a["requested_by"]) for a in listed] == [
        (number, "pending", "ann")
    ]
    own = client.post(f"/api/approvals/{number}/approve", headers=bearer(ann))
    assert own.status_code == 409 and "cannot approve your own" in own.json()["error"]["message"]
    approved = client.post(f"/api/approvals/{number}/approve", headers=bearer(bob))
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert deployed(pool) == 2
    document = client.get("/api/openapi.json", headers=bearer(bob)).json()
    assert "202" in document["paths"]["/api/deployments"]["post"]["responses"]


def test_promotion_and_rollback_wait_too_but_the_controller_does_not(pool: NodePool) -> None:
    ann = person("ann")
    model = ModelVersion.objects.get(model__name="embedder", version=1).model
    rollout = Rollout.objects.create(
        model=model,
        pool=pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
        state=Rollout.State.PAUSED,
        started_by="ann",
    )
    with pytest.raises(ApprovalRequired, match=r"rollout\.promote waits"):
        rollout_promote(rollout_id=rollout.pk, reason="tested", actor=ann)
    with pytest.raises(ApprovalRequired, match=r"release\.rollback waits"):
        release_rollback(model_name="embedder", pool_name="gpu", actor=ann)
    deployment_set(model_name="embedder", version=2, pool=pool, actor="system:rollouts")
    assert deployed(pool) == 2  # automation (a canary that passed its analysis) acts alone
