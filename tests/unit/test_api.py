"""The automation API on its own: tokens, permissions, errors and the schema it publishes.
Schemathesis drives every operation from that schema in tests/unit/test_api_schema.py; a whole
release through the API runs on the real fleet in tests/integration/test_api_release.py."""

import io
import json
import zipfile
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.models import ApiToken, PoolRole
from apps.accounts.roles import Role
from apps.accounts.services import TokenError, token_create
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.registry.imports import repository_import
from tests.support import REPOSITORY
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db


def post(client: Client, path: str, body: object, headers: dict[str, str]) -> object:
    return client.post(path, json.dumps(body), content_type="application/json", headers=headers)


def test_a_token_is_stored_as_a_digest_only_and_a_revoked_one_is_refused(
    client: Client, viewer: User
) -> None:
    record, value = token_create(user=viewer, name="pipeline", actor="system:test")
    with connection.cursor() as cursor:  # nowhere in the row, in any form the ORM might hide
        cursor.execute("SELECT * FROM accounts_apitoken")
        assert not any(value in str(cell) for row in cursor.fetchall() for cell in row)
    headers = {"Authorization": f"Bearer {value}"}
    assert client.get("/api/models", headers=headers).status_code == 200
    assert ApiToken.objects.get().last_used_at is not None
    call_command("api_token", "revoke", str(record.pk))
    refused = client.get("/api/models", headers=headers)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated"
    assert client.get("/api/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/api/models").status_code == 401
    actions = AuditEvent.objects.filter(target="user:viewer-user").values_list("action", flat=True)
    assert {"token.create", "token.revoke"} <= set(actions)


def test_the_command_prints_a_new_token_once_and_lists_none(viewer: User) -> None:
    out = io.StringIO()
    call_command("api_token", "create", "viewer-user", "release pipeline", stdout=out)
    value = out.getvalue().split(": ")[-1].strip()
    assert value.startswith("tcp_") and len(value) > 40
    listing = io.StringIO()
    call_command("api_token", "list", "viewer-user", stdout=listing)
    assert "release pipeline" in listing.getvalue() and value not in listing.getvalue()


def test_a_user_makes_and_revokes_tokens_on_their_page(client: Client, viewer: User) -> None:
    client.force_login(viewer)
    page = client.post("/accounts/tokens/", {"name": "laptop"})
    value = ApiToken.objects.get().prefix
    shown = page.content.decode()
    assert 'id="new-token"' in shown and value in shown and page["Cache-Control"] == "no-store"
    assert 'id="new-token"' not in client.get("/accounts/tokens/").content.decode()  # once
    assert "name the token" in client.post("/accounts/tokens/", {"name": " "}).content.decode()
    other = make_user(Role.OPERATOR)
    theirs, _ = token_create(user=other, name="theirs", actor="system:test")
    client.post(f"/accounts/tokens/{theirs.pk}/revoke/")
    assert ApiToken.objects.get(pk=theirs.pk).revoked_at is None  # not the viewer's to revoke
    client.post(f"/accounts/tokens/{ApiToken.objects.get(user=viewer).pk}/revoke/")
    assert ApiToken.objects.get(user=viewer).revoked_at is not None


def _mutations(client: Client, headers: dict[str, str]) -> list[tuple[str, str]]:
    schema = client.get("/api/openapi.json", headers=headers).json()
    return [
        (method, path.replace("{", "").replace("}", ""))  # any value: refused before it is read
        for path, operations in schema["paths"].items()
        for method in operations
        if method in ("post", "put", "patch", "delete") and not path.endswith("/validate")
    ]


def test_a_viewer_is_refused_every_mutation_and_each_refusal_is_audited(
    client: Client, viewer: User
) -> None:
    headers = bearer(viewer)
    mutations = _mutations(client, headers)
    assert len(mutations) >= 12
    for method, path in mutations:
        before = AuditEvent.objects.count()
        response = getattr(client, method)(
            path, "{}", content_type="application/json", headers=headers
        )
        assert response.status_code == 403, (method, path)
        assert response.json()["error"]["code"] == "forbidden"
        (event,) = AuditEvent.objects.all()[: AuditEvent.objects.count() - before]
        assert (event.actor, event.result, event.target) == ("viewer-user", "denied", path)


def test_errors_say_what_and_where_as_the_pages_do(client: Client, admin_user: User) -> None:
    headers = bearer(admin_user)
    text = 'name: "ocr"\nbackend: "python"\nmax_batch_size: eight\n'
    bad = post(client, "/api/models/ocr/versions", {"pbtxt": text}, headers)
    assert bad.status_code == 422
    error = bad.json()["error"]
    assert error["code"] == "invalid_config"
    assert error["details"][0]["field"] == "line 3, column 17"  # as the version form shows it
    missing = post(client, "/api/rollouts", {"model": "ocr"}, headers).json()["error"]
    assert missing["code"] == "invalid_request"
    assert ["body", "pool"] in [d["loc"] for d in missing["details"]]
    unknown = client.get("/api/models/nope/versions/1", headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    NodePool.objects.create(name="gpu")
    plan = {"model": "rag_pipeline", "pool": "gpu", "canary_version": 2, "plan": "1 node\nhalf"}
    refused = post(client, "/api/rollouts", plan, headers)
    assert refused.status_code in (409, 422)
    assert refused.json()["error"]["message"]


def test_a_rollout_whose_percent_step_gets_more_than_twice_its_share_needs_consent(
    client: Client, admin_user: User
) -> None:
    headers = bearer(admin_user)
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    for n in range(3):
        Node.objects.create(name=f"gpu-{n}", pool=pool, http_url=f"http://10.0.0.{n}:8000")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    body = {"model": "rag_pipeline", "pool": "gpu", "canary_version": 2, "plan": "5%\n100%"}
    refused = post(client, "/api/rollouts", body, headers)
    assert refused.status_code == 422
    assert "33% of requests, on 1 of 3 nodes" in refused.json()["error"]["message"]
    started = post(client, "/api/rollouts", body | {"accept_shares": True}, headers)
    assert started.status_code == 201 and started.json()["plan"][0] == {"percent": 5, "hold_s": 0}


def test_a_version_is_validated_created_published_and_diffed(
    client: Client, admin_user: User
) -> None:
    headers = bearer(admin_user)
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    v1 = client.get("/api/models/embedder/versions/1", headers=headers).json()
    config = {**v1["config"], "max_batch_size": 16}
    config.pop("version_policy", None)
    checked = post(client, "/api/models/embedder/validate", {"config": config}, headers).json()
    assert checked["valid"], checked
    smaller = {**config, "max_batch_size": 4}  # below what rag_pipeline sends it
    checked = post(client, "/api/models/embedder/validate", {"config": smaller}, headers).json()
    assert not checked["valid"] and "max_batch_size 4" in str(checked["breaks"]["rag_pipeline v1"])
    created = post(client, "/api/models/embedder/versions", {"config": config}, headers)
    assert created.status_code == 201
    number = created.json()["version"]
    published = post(
        client, f"/api/models/embedder/versions/{number}/status", {"status": "published"}, headers
    )
    assert published.json()["status"] == "published"
    diff = client.get(f"/api/models/embedder/diff?left=1&right={number}", headers=headers).json()
    changed = [row for row in diff["rows"] if row["kind"] != "equal"]
    assert any("max_batch_size: 16" in row["right"] for row in changed)
    event = AuditEvent.objects.filter(action="version.create").first()
    assert event and (event.actor, event.user) == ("admin-user", admin_user)  # the token's owner
    assert event.via == "API token ci (tcp_" + headers["Authorization"][11:17] + "…)"
    assert set(AuditEvent.objects.filter(actor="admin-user").values_list("via", flat=True)) == {
        event.via
    }


def test_a_repository_layout_imports_from_an_archive(client: Client, admin_user: User) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in (REPOSITORY / "embedder").rglob("*"):
            archive.write(path, path.relative_to(REPOSITORY))
    buffer.seek(0)
    buffer.name = "repo.zip"
    response = client.post("/api/import", {"archive": buffer}, headers=bearer(admin_user))
    assert response.status_code == 200, response.content
    (result,) = response.json()
    assert result["model"] == "embedder" and result["ok"] and result["versions"]


def test_a_canary_node_has_converged_for_the_api_as_for_the_pages(
    client: Client, admin_user: User
) -> None:
    """Converged means one thing: the node serves what its own desired state names (a canary
    node's override included), not what one deployment row says."""
    headers = bearer(admin_user)
    client.force_login(admin_user)
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    deployment_set(model_name="embedder", version=1, pool=pool, actor="system:test")
    deployment_set(model_name="embedder", version=2, baseline=1, node=node, actor="system:test")

    def verdicts(versions: list[int]) -> tuple[list[bool], bool]:
        index = [{"model": "embedder", "version": v, "state": "READY"} for v in versions]
        Node.objects.filter(pk=node.pk).update(index=index)
        found = client.get("/api/deployments", headers=headers).json()
        page = client.get("/deployments/").content.decode()
        return [p["converged"] for d in found for p in d["nodes"]], "1 / 1 nodes converged" in page

    assert verdicts([1, 2]) == ([True, True], True)
    assert verdicts([1]) == ([False, False], False)


def test_nodes_deployments_and_the_timeline_read_back(client: Client, admin_user: User) -> None:
    headers = bearer(admin_user)
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    body = {"model": "embedder", "version": 1, "pool": "gpu"}
    made = post(client, "/api/deployments", body, headers)
    assert made.status_code == 201
    assert made.json()["nodes"] == [
        {"node": "gpu-1", "health": "unknown", "ready": [], "converged": False}
    ]
    (node,) = client.get("/api/nodes", headers=headers).json()
    assert {
        "model": "embedder",
        "desired": [1],
        "ready": [],
        "managed": True,
        "drift": True,
    } in node["models"]
    timeline = client.get("/api/timeline", headers=headers).json()
    assert {"target": "pool:gpu:embedder", "before": None, "after": 1} in timeline["changes"]
    trail = client.get("/api/audit?action=deployment.", headers=headers).json()
    assert [e["action"] for e in trail] == ["deployment.set"]


def test_a_nodes_read_back_shows_before_its_next_poll(client: Client, admin_user: User) -> None:
    """A move back read back by its worker (v2 gone, v1 alone) is what the API and the node's
    page show at once, though the last poll, a moment before, saw both."""
    pool = NodePool.objects.create(name="gpu")
    polled = [{"model": "embedder", "version": str(v), "state": "READY"} for v in (1, 2)]
    node = Node.objects.create(
        name="gpu-1", pool=pool, http_url="http://127.0.0.1:1", index=polled, health="ready"
    )
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=3))
    Operation.objects.create(
        node=node,
        kind="load",
        model_name="embedder",
        versions=[1],
        status="succeeded",
        finished_at=timezone.now(),
        requested_by="oncall",
    )
    (listed,) = client.get("/api/nodes", headers=bearer(admin_user)).json()
    assert [(m["model"], m["ready"]) for m in listed["models"]] == [("embedder", [1])]
    assert client.get("/api/nodes/gpu-1", headers=bearer(admin_user)).json() == listed
    client.force_login(admin_user)
    page = client.get("/nodes/gpu-1/").content.decode()
    row = page.split('id="model-embedder"')[1].split("</tr>")[0]  # its forms hold random tokens
    assert "v1 READY" in row and "v2 READY" not in row


def test_on_call_rolls_a_pool_back_to_its_last_good_release(client: Client, operator: User) -> None:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    pool = NodePool.objects.create(name="gpu")
    for version in (1, 2):
        deployment_set(model_name="rag_pipeline", version=version, pool=pool, actor="ops")
    headers = bearer(operator)
    back = post(client, "/api/pools/gpu/models/rag_pipeline/rollback", {}, headers)
    assert back.json() == {"model": "rag_pipeline", "pool": "gpu", "version": 1}
    assert client.get("/api/deployments", headers=headers).json()[0]["version"] == 1
    nothing = post(client, "/api/pools/gpu/models/rag_pipeline/fallback", {}, headers)
    assert nothing.status_code == 409
    assert "no fallback version" in nothing.json()["error"]["message"]


def test_nul_characters_are_refused_before_they_reach_postgresql(
    client: Client, admin_user: User
) -> None:
    """PostgreSQL text cannot hold NUL; Schemathesis found the 500 it made."""
    headers = bearer(admin_user)
    refused = client.get("/api/audit", {"action": "deploy\x00"}, headers=headers)
    assert refused.status_code == 400
    assert (
        refused.json()["error"]["message"]
        == "NUL characters (0x00) are not allowed in the query string"
    )
    body = post(client, "/api/models/ocr/validate", {"pbtxt": 'name: "o\x00"'}, headers)
    assert body.status_code == 400 and "the JSON body" in body.json()["error"]["message"]
    client.force_login(admin_user)
    page = client.get("/audit/", {"actor": "\x00"})
    assert page.status_code == 400 and b"not allowed in the query string" in page.content
    assert client.get("/api/audit", {"action": "deploy"}, headers=headers).status_code == 200


def test_the_docs_and_the_openapi_document_need_a_sign_in_or_a_token(
    client: Client, viewer: User
) -> None:
    for url in ("/api/docs", "/api/openapi.json"):
        assert client.get(url).status_code == 302  # to the sign-in page
        bad = client.get(url, headers={"Authorization": "Bearer tcp_nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "unauthenticated"
    assert client.get("/api/openapi.json", headers=bearer(viewer)).json()["paths"]
    client.force_login(viewer)
    assert client.get("/api/docs").status_code == 200


def test_a_token_expires_and_its_life_is_bounded(
    client: Client, viewer: User, settings: Any
) -> None:
    record, value = token_create(user=viewer, name="ci", actor="system:test", days=1)
    headers = {"Authorization": f"Bearer {value}"}
    assert client.get("/api/models", headers=headers).status_code == 200
    ApiToken.objects.filter(pk=record.pk).update(expires_at=timezone.now())
    assert client.get("/api/models", headers=headers).status_code == 401
    with pytest.raises(TokenError, match="a token lives 1 to 90 days, not 91"):
        token_create(user=viewer, name="forever", actor="system:test", days=91)
    settings.API_TOKEN_MAX_DAYS = 7
    default, _ = token_create(user=viewer, name="short", actor="system:test")
    assert timedelta(days=6) < default.expires_at - timezone.now() <= timedelta(days=7)


def test_a_read_only_token_reads_but_changes_nothing(client: Client, admin_user: User) -> None:
    _, value = token_create(user=admin_user, name="dash", actor="system:test", scope="read")
    headers = {"Authorization": f"Bearer {value}"}
    assert client.get("/api/models", headers=headers).status_code == 200
    refused = post(client, "/api/models/ocr/validate", {"pbtxt": 'name: "ocr"'}, headers)
    assert refused.status_code == 403 and refused.json()["error"]["message"] == (
        "this token is read-only"
    )
    denied = AuditEvent.objects.get(result=AuditEvent.Result.DENIED)
    assert denied.message == "token dash (" + value[:10] + "…) is read-only"


def test_the_tokens_page_sets_scope_and_expiry(client: Client, viewer: User) -> None:
    client.force_login(viewer)
    client.post("/accounts/tokens/", {"name": "laptop", "scope": "read", "days": "30"})
    token = ApiToken.objects.get()
    life = token.expires_at - token.created_at
    assert token.scope == "read" and abs(life - timedelta(days=30)) < timedelta(seconds=1)
    shown = client.post("/accounts/tokens/", {"name": "x", "days": "9999"}).content.decode()
    assert "a token lives 1 to 90 days, not 9999" in shown


def _tokens(user: User, n: int) -> None:
    """`n` tokens of `user`, the first expiring in 3 days, the others in 60."""
    now = timezone.now()
    ApiToken.objects.bulk_create(
        ApiToken(
            user=user,
            name=f"t{i}",
            prefix=f"p{i}",
            digest=f"{user.pk}-{i}",
            expires_at=now + timedelta(days=3 if i == 0 else 60),
            scope="read",
        )
        for i in range(n)
    )


def test_the_tokens_page_is_paginated_and_marks_those_expiring_within_a_week(
    client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    _tokens(viewer, 5)
    with CaptureQueriesContext(connection) as few:
        body = client.get("/accounts/tokens/").content.decode()
    assert body.count('<tr id="token-') == 5 and "read only" in body
    assert body.count("expires in 2\xa0days") + body.count("expires in 3\xa0days") == 1
    ApiToken.objects.filter(user=viewer).delete()
    _tokens(viewer, 500)
    with CaptureQueriesContext(connection) as many:
        body = client.get("/accounts/tokens/").content.decode()
    assert body.count('<tr id="token-') == 20 and "Page 1 of 25" in body
    assert len(many) == len(few)


def test_an_admin_grants_and_revokes_a_pool_role_through_the_api(
    client: Client, admin_user: User, operator: User
) -> None:
    NodePool.objects.create(name="gpu")
    url = f"/api/pools/gpu/roles/{operator.username}"
    granted = client.put(
        url, {"role": "release_manager"}, "application/json", headers=bearer(admin_user)
    )
    assert granted.status_code == 200
    assert PoolRole.objects.get(user=operator).role == "release_manager"
    listed = client.get("/api/pool-roles?pool=gpu", headers=bearer(admin_user)).json()
    assert listed == [{"user": operator.username, "pool": "gpu", "role": "release_manager"}]
    wrong = client.put(url, {"role": "owner"}, "application/json", headers=bearer(admin_user))
    assert wrong.status_code == 422 and "not 'owner'" in wrong.json()["error"]["message"]
    missing = client.put(
        "/api/pools/cpu/roles/x", {"role": ""}, "application/json", headers=bearer(admin_user)
    )
    assert "no user named 'x'" in missing.json()["error"]["message"]
    assert client.get("/api/pool-roles", headers=bearer(operator)).status_code == 403
    client.put(url, {"role": ""}, "application/json", headers=bearer(admin_user))
    assert not PoolRole.objects.exists()
    trail = AuditEvent.objects.filter(action="user.set_pool_role", result="ok").values_list(
        "after", flat=True
    )
    assert list(trail) == [{"pool": "gpu", "role": ""}, {"pool": "gpu", "role": "release_manager"}]
