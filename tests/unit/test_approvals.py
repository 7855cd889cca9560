"""Two people for a protected pool: a person's deployment, rollout start or retry, promotion,
override or adoption there waits for someone else with the release manager role on the pool,
and expires unapproved; a move back (abort, rollback, fallback) never waits."""

import re
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.accounts.services import user_ensure
from apps.approvals.models import Approval
from apps.approvals.services import (
    ApprovalError,
    approval_approve,
    approval_reject,
    approval_request,
)
from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.nodes import node_adopt, operation_override
from apps.fleet.services.pools import pool_role_set, pool_set_discoverable
from apps.incidents.models import Incident
from apps.incidents.services import incident_rollback
from apps.quality.services import evaluation_set_import
from apps.registry.models import Model, ModelVersion
from apps.registry.services import version_set_status
from apps.rollouts import gate, transitions
from apps.rollouts.members import scope
from apps.rollouts.models import Notification, Rollout
from apps.rollouts.plans import Analysis
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import (
    RolloutError,
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_promote,
    rollout_retry,
    template_save,
)
from tests.support.quality import DEMO_SET, demo_faq
from tests.support.registry import import_demo
from tests.support.users import PASSWORD, bearer, make_user

pytestmark = pytest.mark.django_db
CONTROLLER = "system:rollouts"


@pytest.fixture
def pool() -> NodePool:
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
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


def test_promotion_waits_too_but_the_controller_does_not(pool: NodePool) -> None:
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
    deployment_set(model_name="embedder", version=2, pool=pool, actor="system:rollouts")
    assert deployed(pool) == 2  # automation (a canary that passed its analysis) acts alone


def test_a_promotion_asked_of_a_rollout_that_moved_since_is_not_run(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    rollout = canary_on(pool)
    Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.PAUSED)
    with pytest.raises(ApprovalRequired) as refused:
        rollout_promote(rollout_id=rollout.pk, reason="tested", actor=ann)
    approval = approval_request(refused=refused.value, actor=ann)
    assert approval.resolved == {"rollout": "paused at step 1"}
    Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.PROGRESSING, step=1)
    approved = approval_approve(approval_id=approval.pk, actor=bob)
    assert (approved.status, approved.result) == (
        Approval.Status.FAILED,
        f"rollout #{rollout.pk} was paused at step 1, is progressing at step 2 since it was "
        "asked: ask again",
    )
    assert Rollout.objects.get().state == Rollout.State.PROGRESSING


def canary_on(pool: NodePool) -> Rollout:
    """A rollout of embedder v2 under way on `pool`'s first node, v1 kept beside it."""
    first = Node.objects.create(name=f"{pool.name}-1", pool=pool, http_url="http://127.0.0.1:1")
    Node.objects.create(name=f"{pool.name}-2", pool=pool, http_url="http://127.0.0.1:1")
    deployment_set(model_name="embedder", version=2, baseline=1, node=first, actor=CONTROLLER)
    rollout = Rollout.objects.create(
        model=ModelVersion.objects.get(model__name="embedder", version=1).model,
        pool=pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 50}, {"percent": 100}],
        state=Rollout.State.PROGRESSING,
        canary_nodes=[first.name],
        started_by="ann",
    )
    assert transitions.pool_claim(rollout, "ann") is None  # as its start claims the pool
    return rollout


def test_moves_back_never_wait_for_a_second_person(pool: NodePool) -> None:
    ann, carl = person("ann"), person("carl", Role.OPERATOR)
    Model.objects.filter(name="embedder").update(fallback_version=1)
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    assert release_rollback(model_name="embedder", pool_name="gpu", actor=carl) == 1
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    assert release_fallback(model_name="embedder", pool_name="gpu", actor=carl) == 1
    rollout = canary_on(pool)
    rollout_abort(rollout_id=rollout.pk, actor=ann, reason="answers look wrong")
    assert Rollout.objects.get().state == "aborting"
    assert not Deployment.objects.filter(node__pool=pool).exists()
    assert not Approval.objects.exists()
    switched = AuditEvent.objects.filter(action="release.rollback", result="ok").get()
    assert (switched.actor, switched.message) == ("carl", "rollback by carl")
    assert switched.after["version"] == 1


def test_a_move_back_to_a_deprecated_release_goes_through_and_is_refused_only_in_words(
    pool: NodePool, tmp_path: Path, settings: Any
) -> None:
    """Deprecating the release before a good one is routine: on-call still rolls back, falls
    back and aborts a promotion onto it; only files the nodes cannot load refuse it (a 409)."""
    ann, carl = person("ann"), person("carl", Role.OPERATOR)
    v1 = ModelVersion.objects.get(model__name="embedder", version=1)
    Model.objects.filter(name="embedder").update(fallback_version=1)
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    version_set_status(version_id=v1.pk, status="deprecated", actor="system:test")
    assert release_rollback(model_name="embedder", pool_name="gpu", actor=carl) == 1
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    assert release_fallback(model_name="embedder", pool_name="gpu", actor=carl) == 1
    rollout = canary_on(pool)
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.PROMOTING)
    api = Client(headers=bearer(ann))
    aborted = api.post(
        f"/api/rollouts/{rollout.pk}/abort", {"reason": "p99"}, content_type="application/json"
    )
    assert aborted.status_code == 200, aborted.content
    assert deployed(pool) == 1 and Rollout.objects.get().state == "aborting"
    # Files gone from the repository: said, with where, and nothing changes.
    settings.REGISTRY_ARTIFACT_ROOTS = [str(tmp_path)]
    ModelVersion.objects.filter(pk=v1.pk).update(artifact=str(tmp_path / "embedder" / "1"))
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    refused = Client(headers=bearer(carl)).post("/api/pools/gpu/models/embedder/rollback")
    assert refused.status_code == 409
    assert refused.json()["error"]["message"] == (
        f"cannot move back: embedder v1's files are gone from {tmp_path}/embedder/1"
    )
    assert deployed(pool) == 2
    assert not Approval.objects.exists()


def test_a_move_back_asked_for_before_moves_back_stopped_waiting_is_not_run(
    pool: NodePool,
) -> None:
    """Such a request runs nothing when approved: it says to roll back directly."""
    ann, bob = person("ann"), person("bob")
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    stale = Approval.objects.create(
        pool=pool,
        action="release.rollback",
        params={"model": "embedder", "pool": "gpu"},
        requested_by=ann,
        expires_at=timezone.now() + timedelta(minutes=5),
    )
    approved = approval_approve(approval_id=stale.pk, actor=bob)
    assert approved.status == Approval.Status.FAILED
    assert approved.result == "release.rollback needs no approval now: do it yourself"
    assert deployed(pool) == 2


@pytest.mark.django_db(transaction=True)
def test_an_abort_and_an_incident_rollback_at_once_both_go_through() -> None:
    """A release manager aborts a bad canary on a protected pool while on-call rolls it back
    from the incident: neither waits for anyone, and both are recorded."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL's row locks (SQLite locks the file)")
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu", protected=True)
    deployment_set(model_name="embedder", version=1, pool=pool, actor=CONTROLLER)
    rollout = canary_on(pool)
    ann, carl = person("ann"), person("carl", Role.OPERATOR)
    incident = Incident.objects.create(
        title="embedder slow", started_at=timezone.now(), opened_by="carl", pool=pool
    )
    start = threading.Barrier(2)
    failures: list[BaseException] = []

    def stop(call: Callable[[], object]) -> None:
        try:
            start.wait()
            call()
        except BaseException as exc:  # reported to the test's thread
            failures.append(exc)
        finally:
            connection.close()

    calls = [
        lambda: rollout_abort(rollout_id=rollout.pk, actor=ann, reason="wrong answers"),
        lambda: incident_rollback(
            incident_id=incident.pk, model="embedder", pool="gpu", actor=carl, rollout=rollout.pk
        ),
    ]
    threads = [threading.Thread(target=stop, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert Rollout.objects.get().state == "aborting"
    assert not Deployment.objects.filter(node__pool=pool).exists()
    assert deployed(pool) == 1 and not Approval.objects.exists()
    rollback = AuditEvent.objects.get(action="incident.rollback")
    assert rollback.actor == "carl"
    # Whoever came first took the canary back, named with their reason (on-call's is a part of
    # the incident's event); the second found it going back already, which changes nothing (as
    # a repeated click).
    back = [(e.actor, e.message) for e in AuditEvent.objects.filter(action="rollout.aborting")]
    back += [("carl", p["message"]) for p in rollback.parts if p["action"] == "rollout.aborting"]
    assert back in [
        [("ann", "aborted by ann: wrong answers")],
        [("carl", f"rolled back by carl: incident #{incident.pk}")],
    ]
    assert not AuditEvent.objects.exclude(result="ok").exists()


def start_embedder_v2(analysis: dict[str, object], actor: User) -> Rollout:
    """A whole-pool rollout of embedder v2 on gpu, judged by `analysis`."""
    return rollout_start(
        model_name="embedder",
        pool_name="gpu",
        canary_version=2,
        plan="100%",
        analysis=analysis,
        actor=actor,
    )


def test_a_rollout_start_waits_with_what_it_will_run(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    with pytest.raises(ApprovalRequired, match=r"rollout\.start waits") as refused:
        start_embedder_v2({"window_s": 90}, ann)
    approval = approval_request(refused=refused.value, actor=ann)
    assert approval.params["plan"] == [{"percent": 100, "hold_s": 0}]
    assert approval.params["analysis"] == {**Analysis().as_dict(), "window_s": 90}
    assert approval.resolved == {"release": 1} and not Rollout.objects.exists()
    assert "plan percent=100 hold_s=0, analysis interval_s=10 window_s=90" in approval.summary
    approval_approve(approval_id=approval.pk, actor=bob)
    started = Rollout.objects.get()
    assert (started.started_by, started.plan) == ("ann", approval.params["plan"])
    assert started.analysis == approval.params["analysis"]


def test_an_approved_rollout_runs_the_evaluation_set_and_template_it_showed(
    pool: NodePool,
) -> None:
    """A trivial set (or a template) imported while the start waits changes nothing of it:
    the approval stores their ids, and the gate runs exactly the pinned set."""
    ann, bob = person("ann"), person("bob")
    node = Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    faq = demo_faq()
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=CONTROLLER)
    template_save(name="careful", analysis={"quality_set": "faq"}, pool_name="gpu", actor="ops")
    with pytest.raises(ApprovalRequired) as refused:
        rollout_start(
            model_name="rag_pipeline",
            pool_name="gpu",
            canary_version=2,
            plan="100%",
            analysis=None,
            template="careful",
            actor=ann,
        )
    approval = approval_request(refused=refused.value, actor=ann)
    assert (approval.params["quality_sets"], approval.params["template_version"]) == (
        {"rag_pipeline": faq.pk},
        1,
    )
    assert f"quality_sets rag_pipeline={faq.pk}" in approval.summary
    shown = approval.resolved["sets"]["rag_pipeline"]  # by name and size, and whose it is
    assert shown.startswith(f"faq v1, 30 cases, imported by {faq.created_by} at ")
    trivial = DEMO_SET.read_text().splitlines()[0]
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=trivial, actor="mallory")
    headers = bearer(bob)
    (listed,) = Client().get("/api/approvals", headers=headers).json()
    assert listed["resolved"]["sets"] == {"rag_pipeline": shown}
    page = Client()
    page.force_login(bob)
    assert "gate runs faq v1, 30 cases" in page.get("/rollouts/approvals/").content.decode()
    template_save(
        name="careful",
        analysis={"quality_set": "faq", "quality_min_score": 0.5},
        pool_name="gpu",
        actor="mallory",
    )
    approval_approve(approval_id=approval.pk, actor=bob)
    rollout = Rollout.objects.select_related("template").get()
    assert (rollout.quality_sets, rollout.template.version) == ({"rag_pipeline": faq.pk}, 1)
    where = scope(rollout)
    assert where.canary == [node]
    run = gate.evaluate(rollout, Analysis.from_dict(rollout.analysis), where, when="gate")
    assert run.evaluation_set_id == faq.pk


@pytest.mark.parametrize(
    ("analysis", "refusal"),
    [
        ({"dry_run": True}, "a dry run goes on whatever the verdict"),
        ({"p99_tolerance": 0.5}, "looser than its template careful v1: p99_tolerance 0.5"),
        ({"min_requests": 5}, "min_requests 5, the template's 50"),
        ({"judge": "threshold"}, "judge threshold, not statistical"),
    ],
)
def test_a_protected_pool_refuses_a_dry_run_or_an_analysis_looser_than_its_template(
    pool: NodePool, analysis: dict[str, object], refusal: str
) -> None:
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    template_save(
        name="careful",
        analysis={"p99_tolerance": 0.1, "min_requests": 50},
        pool_name="gpu",
        actor="ops",
    )
    with pytest.raises(RolloutError, match=re.escape(refusal)):
        start_embedder_v2(analysis, person("ann"))
    stricter = {"p99_tolerance": 0.05, "min_requests": 80}
    with pytest.raises(ApprovalRequired):
        start_embedder_v2(stricter, person("ann"))


def test_a_retry_an_override_and_an_adoption_wait_too(pool: NodePool) -> None:
    ann, carl = person("ann"), person("carl", Role.OPERATOR)
    failed = canary_on(pool)
    Rollout.objects.filter(pk=failed.pk).update(state=Rollout.State.ROLLED_BACK)
    with pytest.raises(ApprovalRequired, match=r"rollout\.retry waits") as retry:
        rollout_retry(rollout_id=failed.pk, actor=ann)
    assert retry.value.params["plan"] == failed.plan
    node = Node.objects.get(name="gpu-1")
    refused = Operation.objects.create(
        node=node, kind="load", model_name="embedder", failure="memory", requested_by="x"
    )
    with pytest.raises(ApprovalRequired, match=r"operation\.override waits"):
        operation_override(operation_id=refused.pk, reason="it fits", actor=carl)
    Node.objects.filter(pk=node.pk).update(index=[{"model": "stray", "version": "1"}])
    with pytest.raises(ApprovalRequired, match=r"node\.adopt waits"):
        node_adopt(node_id=node.pk, model_name="stray", actor=carl)
    assert Rollout.objects.count() == 1 and Operation.objects.count() == 1
    assert Node.objects.get(pk=node.pk).owned == []


def test_an_override_or_an_adoption_is_refused_once_its_node_moved(pool: NodePool) -> None:
    bob, carl = person("bob"), person("carl", Role.OPERATOR)
    node = Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    refused = Operation.objects.create(
        node=node, kind="load", model_name="embedder", failure="memory", requested_by="x"
    )
    Node.objects.filter(pk=node.pk).update(index=[{"model": "stray", "version": "1"}])
    asked = []
    for change in (
        lambda: operation_override(operation_id=refused.pk, reason="it fits", actor=carl),
        lambda: node_adopt(node_id=node.pk, model_name="stray", actor=carl),
    ):
        with pytest.raises(ApprovalRequired) as held:
            change()
        asked.append(approval_request(refused=held.value, actor=carl))
    assert [a.resolved for a in asked] == [
        {"planned": refused.pk},
        {"loaded": ["1"], "release": None},
    ]
    newer = Operation.objects.create(
        node=node, kind="load", model_name="embedder", requested_by="x"
    )
    Node.objects.filter(pk=node.pk).update(index=[{"model": "stray", "version": "2"}])

    override, adoption = (approval_approve(approval_id=a.pk, actor=bob) for a in asked)
    assert override.status == adoption.status == "failed"
    assert f"gpu-1 was planned again (operation #{newer.pk})" in override.result
    assert "stray on gpu-1 was v1, is v2 since it was asked" in adoption.result
    assert Operation.objects.count() == 2 and Node.objects.get(pk=node.pk).owned == []


def test_a_removal_or_an_opening_is_refused_once_the_pool_moved(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    embedder = Deployment.objects.get(pool=pool, model__name="embedder")
    asked = []
    for change in (
        lambda: deployment_remove(deployment_id=embedder.pk, actor=ann),
        lambda: pool_set_discoverable(pool_name="gpu", discoverable=True, actor=ann),
    ):
        with pytest.raises(ApprovalRequired) as held:
            change()
        asked.append(approval_request(refused=held.value, actor=ann))
    assert [a.resolved for a in asked] == [{"deployment": 1}, {"discoverable": False}]
    deployment_set(model_name="embedder", version=2, pool=pool, actor=CONTROLLER)
    NodePool.objects.filter(pk=pool.pk).update(discoverable=True)  # another's, approved first

    removal, opening = (approval_approve(approval_id=a.pk, actor=bob) for a in asked)
    assert removal.status == opening.status == "failed"
    assert f"deployment #{embedder.pk} was v1, is v2 since it was asked" in removal.result
    assert "pool gpu is open to discovery now, by someone else" in opening.result
    assert Deployment.objects.get(pk=embedder.pk).version == 2


def test_an_approval_is_refused_once_the_pool_moved(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor=CONTROLLER)
    with pytest.raises(ApprovalRequired) as refused:
        deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor=ann)
    approval = approval_request(refused=refused.value, actor=ann)
    deployment_set(model_name="rag_pipeline", version=3, pool=pool, actor=CONTROLLER)
    approval = approval_approve(approval_id=approval.pk, actor=bob)
    assert approval.status == "failed" and "moved from v1 to v3" in approval.result
    assert Deployment.objects.get(pool=pool, model__name="rag_pipeline").version == 3


def test_a_release_by_hand_during_a_rollout_is_refused_with_the_rollout_named(
    client: Client, pool: NodePool
) -> None:
    NodePool.objects.filter(pk=pool.pk).update(protected=False)
    rollout = canary_on(pool)
    body = {"model": "embedder", "version": 2, "pool": "gpu"}
    refused = client.post(
        "/api/deployments", body, "application/json", headers=bearer(person("ann"))
    )
    assert refused.status_code == 409
    assert f"rollout #{rollout.pk} of embedder v1 → v2" in refused.json()["error"]["message"]
    assert deployed(pool) == 1


def test_a_requester_withdraws_through_the_api_too_and_no_one_else_may(pool: NodePool) -> None:
    ann, bob = person("ann"), person("bob")
    with pytest.raises(ApprovalRequired) as refused:
        deployment_set(model_name="embedder", version=2, pool=pool, actor=ann)
    asked = approval_request(refused=refused.value, actor=ann)
    path = f"/api/approvals/{asked.pk}/withdraw"
    body = {"reason": "wrong pool"}
    denied = Client(headers=bearer(bob)).post(path, body, content_type="application/json")
    assert denied.status_code == 403
    taken = Client(headers=bearer(ann)).post(path, body, content_type="application/json")
    assert taken.status_code == 200
    assert (taken.json()["status"], taken.json()["reason"]) == ("withdrawn", "wrong pool")
    assert deployed(pool) == 1


def test_a_request_is_rejected_with_a_reason_or_withdrawn_and_never_carried_out(
    pool: NodePool,
) -> None:
    ann, bob, cat = person("ann"), person("bob"), person("cat")
    pages = {who: Client() for who in (ann, bob, cat)}
    for who, page in pages.items():
        page.force_login(who)
    pages[ann].post("/deployments/gpu/", {"model_version": "embedder:2"})
    first = Approval.objects.get()
    refused = pages[bob].post(f"/rollouts/approvals/{first.pk}/reject/", {"reason": " "})
    assert "say why it is rejected" in pages[bob].get(refused["Location"]).content.decode()
    mine = pages[ann].post(f"/rollouts/approvals/{first.pk}/reject/", {"reason": "no"})
    assert "withdraw it instead" in pages[ann].get(mine["Location"]).content.decode()
    pages[bob].post(f"/rollouts/approvals/{first.pk}/reject/", {"reason": "not before the demo"})
    first.refresh_from_db()
    assert (first.status, first.rejected_by, first.reason) == (
        "rejected",
        bob,
        "not before the demo",
    )
    seen = pages[ann].get("/rollouts/approvals/").content.decode()
    assert 'rejected</span> by bob: <q class="reason">not before the demo</q>' in seen
    with pytest.raises(ApprovalError, match="is rejected already"):
        approval_approve(approval_id=first.pk, actor=cat)
    # Asked again, then taken back by its requester alone.
    pages[ann].post("/deployments/gpu/", {"model_version": "embedder:2"})
    second = Approval.objects.get(status="pending")
    assert pages[bob].post(f"/rollouts/approvals/{second.pk}/withdraw/").status_code == 403
    pages[ann].post(f"/rollouts/approvals/{second.pk}/withdraw/", {"reason": "wrong pool"})
    second.refresh_from_db()
    assert (second.status, second.reason) == ("withdrawn", "wrong pool")
    assert deployed(pool) == 1  # neither was carried out
    actions = AuditEvent.objects.filter(action__in=["approval.reject", "approval.withdraw"])
    assert sorted((e.action, e.result, e.actor) for e in actions) == [
        ("approval.reject", "failed", "ann"),
        ("approval.reject", "failed", "bob"),
        ("approval.reject", "ok", "bob"),
        ("approval.withdraw", "denied", "bob"),
        ("approval.withdraw", "ok", "ann"),
    ]
    # The page filters by state and pool.
    rejected = pages[cat].get("/rollouts/approvals/", {"status": "rejected", "pool": "gpu"})
    assert re.findall(r'<tr id="approval-(\d+)"', rejected.content.decode()) == [str(first.pk)]
    other = pages[cat].get("/rollouts/approvals/", {"pool": "cpu"}).content.decode()
    assert "No approval matches these filters." in other


def test_a_request_and_its_rejection_are_told_to_the_webhook(
    pool: NodePool, settings: object
) -> None:
    settings.ROLLOUT_WEBHOOK_URL = "http://127.0.0.1:1/hook"  # type: ignore[attr-defined]
    ann, bob = person("ann"), person("bob")
    page = Client()
    page.force_login(ann)
    page.post("/deployments/gpu/", {"model_version": "embedder:2"})
    approval = Approval.objects.get()
    approval_reject(approval_id=approval.pk, reason="not before <!channel> the demo", actor=bob)
    sent = [n.payload for n in Notification.objects.order_by("id")]
    assert [p["approval"]["event"] for p in sent] == ["approval_pending", "approval_rejected"]
    assert "asked by ann waits for a second person until" in sent[0]["text"]
    assert (
        "deployment.set asked by ann is rejected by bob: not before &lt;!channel&gt; the demo"
        in sent[1]["text"]
    )
    assert sent[1]["approval"]["url"].endswith("/rollouts/approvals/?pool=gpu")


def test_the_api_rejects_with_a_reason(pool: NodePool, client: Client) -> None:
    ann, bob = person("ann"), person("bob")
    body = {"model": "embedder", "version": 2, "pool": "gpu"}
    client.post("/api/deployments", body, "application/json", headers=bearer(ann))
    number = Approval.objects.get().pk
    url = f"/api/approvals/{number}/reject"
    blank = client.post(url, {"reason": ""}, "application/json", headers=bearer(bob))
    assert blank.status_code == 409 and "say why" in blank.json()["error"]["message"]
    done = client.post(url, {"reason": "freeze"}, "application/json", headers=bearer(bob))
    assert done.status_code == 200
    assert (done.json()["status"], done.json()["rejected_by"], done.json()["reason"]) == (
        "rejected",
        "bob",
        "freeze",
    )
