"""Degradation tiers set by hand, and a person's pin on one: validated, audited, and one owner
of what a pool serves at a time (a pin holds a person's deployments and rollouts off; a running
rollout holds a pin off)."""

import copy
import json
import re
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.audit.services import Actor
from apps.degradation.models import Tiers
from apps.degradation.services import (
    TierError,
    tier_confirm,
    tier_pin,
    tier_unpin,
    tiers_set,
)
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, Node, NodePool, PoolOwner
from apps.fleet.owners import owner_holding
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from apps.rollouts import transitions
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import RolloutError
from tests.support.audit import DEGRADATION_SERVICES, Case, assert_one_event_each
from tests.support.registry import import_demo
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db
PIPELINE = "rag_pipeline"


@pytest.fixture
def pool() -> NodePool:
    """Pool demo serving rag_pipeline v1, the demo repository imported (v4: no reranker)."""
    import_demo()
    pool = NodePool.objects.create(name="demo")
    for i in range(2):
        Node.objects.create(name=f"demo-{i}", pool=pool, http_url="http://127.0.0.1:1")
    deployment_set(model_name=PIPELINE, version=1, pool=pool, actor="system:test")
    return pool


def serving(pool: NodePool) -> int:
    return Deployment.objects.get(pool=pool, model__name=PIPELINE).version


def roll_out(actor: Actor) -> Rollout:
    """A rollout of the pipeline's v2 on pool demo, in two steps."""
    return rollout_start(
        model_name=PIPELINE,
        pool_name="demo",
        canary_version=2,
        plan="50%\n100%",
        analysis=None,
        actor=actor,
    )


def pin(tier: int = 1, **changes: object) -> Tiers:
    args = {"reason": "P99 over budget, rerank skipped", "hours": 2.0, "actor": "oncall"}
    return tier_pin(pool_name="demo", model_name=PIPELINE, tier=tier, **(args | changes))


def test_tiers_are_published_versions_answering_as_the_primary_does(pool: NodePool) -> None:
    model = Model.objects.get(name=PIPELINE)
    config = copy.deepcopy(model.versions.get(version=1).config)
    config["output"][0]["name"] = "REPLY"
    ModelVersion.objects.create(model=model, version=20, config=config, status="published")
    ModelVersion.objects.create(model=model, version=21, config=config)  # a draft
    refusals = {
        (1,): "two or more versions, the primary first, each newer than the one above it",
        (1, 1): "two or more versions, the primary first, each newer than the one above it",
        (4, 1): "register a lighter release again as a newer version), not [4, 1]",
        (1, 99): "rag_pipeline has no v99",
        (1, 21): "rag_pipeline v21 is draft, not published",
        (1, 20): "v20's outputs (REPLY, SOURCE) differ from the primary v1's",
        (1, 14): "v14 streams its answer and the primary v1 does not: a caller would notice",
    }
    for versions, message in refusals.items():
        with pytest.raises(TierError, match=re.escape(message)):
            tiers_set(pool_name="demo", model_name=PIPELINE, versions=list(versions), actor="rm")
    tiers = tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    assert tiers.versions == [1, 4] and not tiers.pin_holds()
    event = AuditEvent.objects.filter(action="pool.set_tiers", result="ok").get()
    stand_by = {  # the tier below's steps, loaded unserved: a first step down loads nothing
        "action": "deployment.set",
        "target": "pool:demo:rag_pipeline",
        "before": {"version": 1},
        "after": {"version": 1, "standby": 4},
    }
    assert (event.target, event.before, event.after) == (
        "pool:demo:rag_pipeline",
        {"versions": []},
        {"versions": [1, 4], "parts": [stand_by]},
    )
    assert serving(pool) == 1  # setting tiers switches nothing
    again = AuditEvent.objects.filter(action="pool.set_tiers", result="ok")
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    assert Deployment.objects.get(pool=pool).standby_version == 4
    assert again.count() == 1  # the same tiers, standing by already: nothing changed


def test_on_a_protected_pool_tiers_wait_for_a_second_person_and_start_at_what_it_serves(
    pool: NodePool,
) -> None:
    """Tiers are releases a pin or the automation puts the pool on alone: one release manager
    cannot make v4 the pool's by naming it a tier, nor name a primary the pool does not serve."""
    from apps.accounts.permissions import ApprovalRequired
    from apps.accounts.services import user_ensure
    from apps.approvals.services import approval_approve, approval_request
    from tests.support.users import PASSWORD

    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    NodePool.objects.filter(pk=pool.pk).update(protected=True)
    make_user(Role.VIEWER)  # the role groups
    ann, bob = (
        user_ensure(username=name, password=PASSWORD, role=Role.RELEASE_MANAGER)
        for name in ("ann", "bob")
    )
    with pytest.raises(TierError, match=re.escape("serves v1: the primary (tier 0) is what it")):
        tiers_set(pool_name="demo", model_name=PIPELINE, versions=[2, 4], actor=ann)
    with pytest.raises(ApprovalRequired, match=r"pool\.set_tiers waits") as held:
        tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor=ann)
    assert not Tiers.objects.exists()
    approval = approval_request(refused=held.value, actor=ann)
    assert approval_approve(approval_id=approval.pk, actor=bob).status == "approved"
    assert Tiers.objects.get().versions == [1, 4]
    assert pin(1).pinned == 1 and serving(pool) == 4  # on-call moves within them alone
    # Degraded, the pool's tiers still start at their primary.
    tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall")
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4, 5], actor="system:test")


def test_a_pin_switches_the_pool_now_and_holds_every_other_owner_off(pool: NodePool) -> None:
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    tiers = pin(1)
    assert serving(pool) == 4 and tiers.pin_holds()
    event = AuditEvent.objects.get(action="pool.pin_tier")
    assert event.message == "P99 over budget, rerank skipped"
    assert [part["action"] for part in event.parts] == ["deployment.set"]
    held = "rag_pipeline on demo is pinned to tier 1 (v4) by oncall until"
    assert owner_holding(pool, tiers.model).why.startswith(held)  # type: ignore[union-attr]
    release_manager = make_user(Role.RELEASE_MANAGER)
    with pytest.raises(FleetError, match=re.escape(held)):
        deployment_set(model_name=PIPELINE, version=2, pool=pool, actor=release_manager)
    with pytest.raises(RolloutError, match=re.escape(held)):
        roll_out(release_manager)
    with pytest.raises(TierError, match=re.escape(held)):
        tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4, 5], actor="rm")
    tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall")
    assert serving(pool) == 4  # lifting a pin moves nothing...
    deployment_set(model_name=PIPELINE, version=2, pool=pool, actor=release_manager)
    assert serving(pool) == 2  # ...and the pool is anyone's again


def test_a_pin_says_why_for_how_long_and_waits_for_a_running_rollout(pool: NodePool) -> None:
    with pytest.raises(TierError, match="has no tiers: set them first"):
        pin(1)
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    for changes, message in [
        ({"tier": 2}, "tier 2: rag_pipeline on demo has tiers 0 to 1"),
        ({"reason": "  "}, "a pin needs a reason"),
        ({"hours": 0}, "at most 168 hours, not 0"),
        ({"hours": 169}, "at most 168 hours, not 169"),
        (
            {"hours": 13, "actor": make_user(Role.OPERATOR)},
            re.escape("at most 12 hours when on-call sets it (a release manager's, a week)"),
        ),
    ]:
        with pytest.raises(TierError, match=message):
            pin(**changes)
    assert pin(0, hours=12, actor=make_user(Role.OPERATOR)).pin_holds()
    tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall")
    roll_out("system:test")
    with pytest.raises(TierError, match="abort it, or roll the pool back"):
        pin(1)
    assert serving(pool) == 1


def test_an_expired_pin_holds_nothing(pool: NodePool) -> None:
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    tiers = pin(1)
    lapsed = timezone.now() - timedelta(seconds=1)
    Tiers.objects.filter(pk=tiers.pk).update(pinned_until=lapsed)
    PoolOwner.objects.update(until=lapsed)  # as the pin's claim lapses with it
    assert owner_holding(pool, tiers.model) is None
    deployment_set(model_name=PIPELINE, version=2, pool=pool, actor=make_user(Role.RELEASE_MANAGER))
    assert serving(pool) == 2


def confirm(cleared: int | None = None) -> Tiers:
    """On-call's go for a switch back up that the automation's probes cleared (`cleared`)."""
    if cleared is not None:
        Tiers.objects.update(cleared=cleared)
    return tier_confirm(pool_name="demo", model_name=PIPELINE, actor="oncall")


def test_each_service_records_one_event_refused_or_done(pool: NodePool) -> None:
    cases = [
        Case(
            tiers_set,
            "pool.set_tiers",
            lambda: tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1], actor="rm"),
            lambda: tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm"),
        ),
        Case(tier_pin, "pool.pin_tier", lambda: pin(5), lambda: pin(1)),
        Case(
            tier_unpin,
            "pool.unpin_tier",
            lambda: tier_unpin(pool_name="nowhere", model_name=PIPELINE, actor="oncall"),
            lambda: tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall"),
        ),
        Case(tier_confirm, "pool.confirm_restore", lambda: confirm(), lambda: confirm(cleared=0)),
    ]
    assert {case.service for case in cases} == DEGRADATION_SERVICES
    assert_one_event_each(cases)


def test_the_commands_set_pin_and_unpin(pool: NodePool) -> None:
    call_command("set_tiers", "demo", PIPELINE, "v1,v4")
    call_command("pin_tier", "demo", PIPELINE, "1", "--reason", "drill", "--hours", "1")
    assert serving(pool) == 4
    call_command("pin_tier", "demo", PIPELINE, "--unpin")
    assert not Tiers.objects.get().pin_holds()
    with pytest.raises(CommandError, match="numbers separated by commas"):
        call_command("set_tiers", "demo", PIPELINE, "one,four")
    with pytest.raises(CommandError, match="a pin needs a reason"):
        call_command("pin_tier", "demo", PIPELINE, "1")
    actors = set(AuditEvent.objects.values_list("actor", flat=True))
    assert {"system:set_tiers", "system:pin_tier"} <= actors


def test_the_api_reads_sets_pins_and_unpins(client: Client, pool: NodePool) -> None:
    url = f"/api/pools/demo/models/{PIPELINE}/tiers"
    manager, oncall = bearer(make_user(Role.RELEASE_MANAGER)), bearer(make_user(Role.OPERATOR))
    assert client.get(url, headers=oncall).status_code == 404
    body = json.dumps({"versions": [1, 4]})
    put = client.put(url, body, content_type="application/json", headers=manager)
    assert put.status_code == 200 and put.json()["versions"] == [1, 4]
    assert client.put(url, body, content_type="application/json", headers=oncall).status_code == 403
    pinned = client.post(
        url + "/pin",
        {"tier": 1, "reason": "drill", "hours": 1},
        content_type="application/json",
        headers=oncall,
    )
    assert pinned.status_code == 200, pinned.content
    found = client.get(url, headers=oncall).json()
    assert (found["serving"], found["pinned"], found["pinned_by"]) == (4, 1, "operator-user")
    refused = client.put(
        url, json.dumps({"versions": [1, 2]}), content_type="application/json", headers=manager
    )
    assert refused.status_code == 409 and "unpin it" in refused.json()["error"]["message"]
    unpinned = client.delete(url + "/pin", headers=oncall)
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is None
    assert client.post(url + "/confirm", headers=oncall).status_code == 409  # nothing cleared
    Tiers.objects.update(cleared=0, probed="probes of v1: P99 40 ms")
    confirmed = client.post(url + "/confirm", headers=oncall)
    assert confirmed.status_code == 200 and confirmed.json()["serving"] == 1
    assert confirmed.json()["probed"] == "probes of v1: P99 40 ms"


def test_one_owner_at_a_time_shown_on_the_deployments_page(pool: NodePool, client: Client) -> None:
    """A pin owns the pool's release until it is lifted: a rollout waits, then owns it in turn
    until it ends, and the pool's card says who drives it."""
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4], actor="rm")
    pin(0)
    with pytest.raises(RolloutError, match=r"is pinned to tier 0 .* unpin it before"):
        roll_out("system:test")
    client.force_login(make_user(Role.VIEWER))
    assert "rag_pipeline: pin by oncall until" in client.get("/deployments/").content.decode()
    tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall")
    rollout = roll_out("system:test")
    (owner,) = PoolOwner.objects.all()
    assert (owner.kind, owner.ref) == ("rollout", f"rollout:{rollout.pk}")
    page = client.get("/deployments/").content.decode()
    assert f'rag_pipeline: <a href="/rollouts/{rollout.pk}/">rollout #{rollout.pk}</a>' in page
    transitions.transition(rollout, Rollout.State.ROLLED_BACK)
    assert not PoolOwner.objects.exists()
    assert "Driven by: the reconciler</p>" in client.get("/deployments/").content.decode()
