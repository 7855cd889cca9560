"""Who may change what, shown on every URL of the URL conf and every operation of the OpenAPI
document, not a hand-picked list: a viewer and a user with no role are refused every change; a
release manager of pool a is refused every change on pool b; a read-only token changes nothing."""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from apps.accounts.models import ApiToken, PoolRole
from apps.accounts.roles import Role
from apps.accounts.services import roles_sync, token_create
from apps.approvals.models import Approval
from apps.audit.models import AuditEvent
from apps.degradation.models import Tiers
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.services.pools import pool_role_set
from apps.performance.models import PerfSearch
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.registry.models import ModelVersion
from apps.rollouts.forms import RolloutForm
from apps.rollouts.models import Rollout
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = pytest.mark.django_db

# Pages that take POST without changing what others share: the signed-in user's own session and
# tokens, open to every role, and a dry run; the same dry run in the API.
PERSONAL = {"accounts:login", "accounts:logout", "accounts:tokens", "accounts:token_revoke"}
DRY_RUNS = {"registry:version_validate"}
READ_ONLY_POSTS = {("post", "/api/models/{name}/validate"), ("post", "/api/desired/validate")}


@dataclass
class World:
    pool_b: NodePool
    node_b: Node
    deployment_b: Deployment
    rollout_b: Rollout
    node_a: Node
    token_id: int
    approval_b: Approval
    search_b: PerfSearch


@pytest.fixture
def world() -> World:
    roles_sync()
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    a, b = NodePool.objects.create(name="a"), NodePool.objects.create(name="b")
    loaded = [{"model": "embedder", "version": 1, "state": "READY", "reason": ""}]
    node_a = Node.objects.create(name="a-1", pool=a, http_url="http://10.0.0.1:8000")
    node_b = Node.objects.create(
        name="b-1", pool=b, http_url="http://10.0.0.2:8000", index=loaded, owned=["retriever"]
    )
    model = ModelVersion.objects.get(model__name="embedder", version=1).model
    for pool in a, b:
        Deployment.objects.create(pool=pool, model=model, version=1, created_by="ops")
    rollout_b = Rollout.objects.create(
        model=model,
        pool=b,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
        state=Rollout.State.PAUSED,
        started_by="ops",
    )
    token, _ = token_create(user=make_user(Role.VIEWER), name="mine", actor="system:test")
    approval_b = Approval.objects.create(
        pool=b,
        action="deployment.set",
        params={"pool": "b", "model": "embedder", "version": 2, "baseline": None},
        requested_by=make_user(Role.RELEASE_MANAGER),
        expires_at=timezone.now() + timedelta(hours=1),
    )
    deployment_b = Deployment.objects.get(pool=b)
    Tiers.objects.create(pool=b, model=model, versions=[1, 2])
    search_b = PerfSearch.objects.create(
        pipeline=ModelVersion.objects.get(model__name="rag_pipeline", version=1).model,
        version=1,
        step="reranker",
        pool_name="b",
        node=node_b,
        node_name="b-1",
        concurrency=4,
        requests=100,
        status=PerfSearch.Status.DONE,
        requested_by="ops",
    )
    return World(b, node_b, deployment_b, rollout_b, node_a, token.pk, approval_b, search_b)


def forms(world: World) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Pages that change something: (their arguments, the form a person would send), always
    aiming at pool b."""
    rollout_form = {
        name: field.initial for name, field in RolloutForm().fields.items() if field.initial
    } | {"model": "embedder", "pool": "b", "canary_version": 2, "start": "1"}
    node, version = {"name": "b-1"}, {"name": "embedder", "version": 1}
    pool_model = {"pool": "b", "model": "embedder"}
    viewer = ApiToken.objects.get(pk=world.token_id).user.username
    return {
        "fleet:node_load": (node, {"model_version": "embedder:2"}),
        "fleet:node_operate": (node, {"kind": "reload", "model": "embedder"}),
        "fleet:deployment_create": ({"pool": "b"}, {"model_version": "embedder:2"}),
        "fleet:deployment_delete": ({"deployment_id": world.deployment_b.pk}, {}),
        "registry:import": ({}, {}),
        "registry:version_new": ({"name": "embedder"}, {"pbtxt": 'name: "embedder"'}),
        "registry:version_status": (version, {"status": "deprecated"}),
        "rollouts:rollout_new": ({}, rollout_form),
        "rollouts:rollout_act": ({"pk": world.rollout_b.pk, "action": "resume"}, {}),
        "rollouts:release_roll_back": ({"pool": "b", "model": "embedder", "to": "last-good"}, {}),
        "approvals:approve": ({"pk": world.approval_b.pk}, {}),
        "approvals:reject": ({"pk": world.approval_b.pk}, {"reason": "not now"}),
        "approvals:withdraw": ({"pk": world.approval_b.pk}, {"reason": "not needed"}),
        "accounts:token_revoke": ({"token_id": world.token_id}, {}),
        "quality:set_import": ({"name": "embedder"}, {"name": "x", "text": "{}"}),
        "quality:run_start": ({"name": "embedder", "set_name": "x", "version": 1}, {"version": 1}),
        "degradation:pin": (pool_model, {"tier": "0", "reason": "drill", "hours": "1"}),
        "degradation:unpin": (pool_model, {}),
        "degradation:confirm": (pool_model, {}),
        "degradation:set": ({"pool": "b"}, {"model": "embedder", "versions": "1,2"}),
        "scaling:pin": ({"pool": "b"}, {"nodes": "2", "reason": "drill"}),
        "scaling:bounds": ({"pool": "b"}, {"least": "2", "most": "4"}),
        "fleet:pool_roles": ({}, {"user": viewer, "pool": "b", "role": "operator"}),
        "performance:search_start": (
            {"name": "rag_pipeline"},
            {"pool": "b", "step": "reranker", "concurrency": 4, "requests": 100},
        ),
        "rollouts:search_release": ({"pk": world.search_b.pk}, {}),
        "rollouts:tune": (
            {"name": "rag_pipeline"},
            {"pool": "b", "step": "reranker", "change": "more instances: 1 -> 2"},
        ),
    }


def patterns() -> Iterator[tuple[str, str]]:
    """(namespace:name, route) of every URL pattern but Django's admin."""

    def walk(found: list[Any], prefix: str, namespace: str) -> Iterator[tuple[str, str]]:
        for pattern in found:
            if isinstance(pattern, URLResolver):
                if pattern.app_name == "admin":
                    continue
                inner = pattern.namespace or namespace
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern), inner)
            elif isinstance(pattern, URLPattern) and pattern.name:
                yield f"{namespace}:{pattern.name}", prefix + str(pattern.pattern)

    yield from walk(get_resolver().url_patterns, "", "")


def url(route: str, kwargs: dict[str, Any]) -> str:
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(kwargs.get(m[1], "x")), route)


def changes() -> tuple[int, ...]:
    """What a change would leave behind (denials in the audit trail aside)."""
    return (
        Deployment.objects.count(),
        Operation.objects.count(),
        Rollout.objects.exclude(state=Rollout.State.PAUSED).count() + Rollout.objects.count(),
        ModelVersion.objects.exclude(status=ModelVersion.Status.PUBLISHED).count(),
        ApiToken.objects.filter(revoked_at__isnull=False).count(),
        Approval.objects.exclude(status=Approval.Status.PENDING).count(),
        AuditEvent.objects.exclude(result=AuditEvent.Result.DENIED).count(),
        EvaluationSet.objects.count(),
        EvaluationRun.objects.count(),
        Tiers.objects.filter(pinned__isnull=False).count(),
        PoolRole.objects.count(),
        PerfSearch.objects.count(),
    )


def reading(name: str, world: World) -> dict[str, Any]:
    """Arguments of a page that only reads, by what its URL names."""
    fleet = name.startswith("fleet:")
    return {"name": "b-1" if fleet else "embedder", "version": 1, "pk": world.rollout_b.pk}


def pages_posted_by(client: Client, world: World) -> dict[str, int]:
    """The status of a POST to every page (but the personal ones), with pool b's arguments."""
    changing = forms(world)
    statuses = {}
    for name, route in patterns():
        if name in PERSONAL | DRY_RUNS or name.startswith("api:"):
            continue
        kwargs, form = changing.get(name, (reading(name, world), {}))
        statuses[name] = client.post(url(route, kwargs), form).status_code
    return statuses


@pytest.mark.parametrize(
    "role", ["viewer", "no role", "operator of pool a", "release manager of pool a"]
)
def test_no_page_changes_anything_for_who_may_not(world: World, role: str) -> None:
    user = {
        "viewer": lambda: make_user(Role.VIEWER),
        "no role": lambda: User.objects.create_user("nobody", password="x"),
        "operator of pool a": lambda: role_on_a("operator"),
        "release manager of pool a": lambda: role_on_a("release_manager"),
    }[role]()
    client = Client()
    client.force_login(user)
    before = changes()
    statuses = pages_posted_by(client, world)
    # 403: refused; 405: a page that only reads (it takes no POST at all).
    assert {name: s for name, s in statuses.items() if s not in (403, 405)} == {}
    assert changes() == before
    guarded = {name for name, s in statuses.items() if s == 403}
    assert set(forms(world)) - PERSONAL <= guarded  # every changing page was reached


def role_on_a(role: str) -> User:
    """A viewer everywhere, with `role` on pool a."""
    user = make_user(Role.VIEWER)
    pool_role_set(username=user.username, pool_name="a", role=role, actor="ops")
    return user


def test_a_pool_role_acts_on_its_own_pool(world: World) -> None:
    """The same person, on pool a: the role is real, not a refusal of everything."""
    client = Client()
    client.force_login(role_on_a("release_manager"))
    response = client.post("/nodes/a-1/load/", {"model_version": "embedder:2"})
    assert response.status_code == 302
    assert Deployment.objects.get(node=world.node_a).version == 2
    refused = client.post("/nodes/b-1/load/", {"model_version": "embedder:2"})
    assert refused.status_code == 403
    assert (
        "may not do that on pool b: it needs fleet.operate_node there" in refused.content.decode()
    )
    event = AuditEvent.objects.filter(action="deployment.set").latest("id")
    assert (event.result, event.target) == ("denied", "node:b-1:embedder")


def test_a_user_with_no_role_reads_nothing(world: World, client: Client) -> None:
    client.force_login(User.objects.create_user("nobody", password="x"))
    for path in ("/", "/audit/export.csv", "/models/embedder/v1/repository.zip", "/api/docs"):
        assert client.get(path).status_code == 403, path


def operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, path, operation) of every operation in the OpenAPI document."""
    client = Client()
    client.force_login(make_user(Role.ADMIN))
    document = client.get("/api/openapi.json").json()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method, path, operation


def api_path(path: str, world: World) -> str:
    values = {
        "name": "b-1" if path.startswith("/api/nodes/") else "embedder",
        "pool": "b",
        "model": "embedder",
        "rollout_id": world.rollout_b.pk,
        "deployment_id": world.deployment_b.pk,
        "approval_id": world.approval_b.pk,
        "version": 1,
        "username": "viewer-user",
    }
    return re.sub(r"{(\w+)}", lambda m: str(values[m[1]]), path)


API_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/api/deployments"): {"model": "embedder", "version": 2, "pool": "b"},
    ("post", "/api/nodes/{name}/operations"): {"kind": "reload", "model": "embedder"},
    ("post", "/api/rollouts"): {
        "model": "embedder",
        "pool": "b",
        "canary_version": 2,
        "plan": "100%",
    },
    ("post", "/api/rollouts/{rollout_id}/promote"): {"reason": "tested"},
    ("post", "/api/approvals/{approval_id}/reject"): {"reason": "not now"},
    ("put", "/api/pools/{pool}/models/{model}/tiers"): {"versions": [1, 2]},
    ("post", "/api/pools/{pool}/models/{model}/tiers/pin"): {"tier": 0, "reason": "drill"},
    ("post", "/api/pools/{pool}/discoverable"): {"discoverable": True},
    ("put", "/api/pools/{pool}/scaling/pin"): {"nodes": 2, "reason": "drill"},
    ("post", "/api/desired/apply"): {"files": {"b.yaml": "pool: b\nqueue: q\n"}, "commit": "c"},
    ("put", "/api/pools/{pool}/scaling/bounds"): {"least": 2, "most": 4},
    ("put", "/api/pools/{pool}/roles/{username}"): {"role": "release_manager"},
}


@pytest.mark.parametrize(
    "who",
    [
        "viewer",
        "no role",
        "read-only token of an admin",
        "operator of pool a",
        "release manager of pool a",
    ],
)
def test_no_api_operation_changes_anything_for_who_may_not(world: World, who: str) -> None:
    user, scope = {
        "viewer": (lambda: make_user(Role.VIEWER), "write"),
        "no role": (lambda: User.objects.create_user("nobody", password="x"), "write"),
        "read-only token of an admin": (lambda: make_user(Role.ADMIN), "read"),
        "operator of pool a": (lambda: role_on_a("operator"), "write"),
        "release manager of pool a": (lambda: role_on_a("release_manager"), "write"),
    }[who]
    mutating = [
        (method, path)
        for method, path, _ in operations()
        if method in ("post", "put", "patch", "delete") and (method, path) not in READ_ONLY_POSTS
    ]
    assert len(mutating) >= 14  # registry, fleet and rollouts: the test must see them all
    _, value = token_create(user=user(), name="t", actor="system:test", scope=scope)
    headers = {"Authorization": f"Bearer {value}"}
    before = changes()
    client = Client()
    statuses = {}
    for method, path in mutating:
        body = json.dumps(API_BODIES.get((method, path), {}))
        call = getattr(client, method)
        statuses[(method, path)] = call(
            api_path(path, world), body, content_type="application/json", headers=headers
        ).status_code
    assert {op: s for op, s in statuses.items() if s != 403} == {}
    assert changes() == before
    assert PoolRole.objects.count() == (1 if who.endswith("of pool a") else 0)


def test_a_pool_role_shows_its_buttons_on_its_pool_only(world: World, client: Client) -> None:
    client.force_login(role_on_a("operator"))
    deployments = client.get("/deployments/").content.decode()
    # Releasing to a whole pool is a release manager's; an operator's pool role still removes.
    assert "Deploy to a</button>" not in deployments and "Remove</button>" in deployments
    client.force_login(role_on_a("release_manager"))
    deployments = client.get("/deployments/").content.decode()
    assert "Deploy to a</button>" in deployments and "Deploy to b</button>" not in deployments
    assert "Load a model version on a-1" in client.get("/nodes/a-1/").content.decode()
    assert "Load a model version on b-1" not in client.get("/nodes/b-1/").content.decode()
