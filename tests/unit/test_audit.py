import csv
import importlib
import inspect
import io
import json
import re
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import ApiToken
from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.api.api import api
from apps.api.auth import Token
from apps.approvals import services as approvals
from apps.approvals.models import Approval
from apps.audit.actions import ACTIONS
from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.audit.services import audit_event, audit_record, audit_update
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.services import deployments, nodes, pools
from apps.performance import services as performance
from apps.quality import services as quality
from apps.quality.models import EvaluationSet
from apps.registry import imports
from apps.registry import services as registry
from apps.registry.models import Model, ModelVersion
from tests.support import REPOSITORY
from tests.support.audit import (
    DEGRADATION_SERVICES,
    ROLLOUT_SERVICES,
    Case,
    assert_one_event_each,
)

CONFIG = {"name": "rag", "backend": "python", "max_batch_size": 8}


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="LIKE twins are PostgreSQL's")
def test_the_trail_and_the_operations_are_written_into_no_index_that_no_query_uses() -> None:
    """Each event and each operation's plan, claim and end is written into every index of its
    table, as the migrations left them: a LIKE twin only where a prefix is looked up (the
    trail's filter, a rollout's events), a node's operations in order, and only the open ones
    indexed by status (a node's and the fleet's work under way)."""

    def indexes(table: str) -> dict[str, list[str]]:
        with connection.cursor() as cursor:
            found = connection.introspection.get_constraints(cursor, table)
        return {name: c["columns"] for name, c in found.items() if c["index"]}

    operations = indexes("fleet_operation")
    assert sorted(operations.values()) == [
        ["finished_at", "id"],
        ["node_id", "id"],
        ["node_id", "status", "seq"],
    ], operations
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'fleet_operation_open'")
        assert "WHERE" in cursor.fetchone()[0]  # partial: the open ones only
    like = sorted(c for name, (c, *_) in indexes("audit_auditevent").items() if "_like" in name)
    assert like == ["action", "target"]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the trigger is PostgreSQL's")
def test_the_database_refuses_to_change_or_delete_an_event(trail: list[AuditEvent]) -> None:
    for statement in (
        "UPDATE audit_auditevent SET actor = 'someone else'",
        "DELETE FROM audit_auditevent",
    ):
        with (
            pytest.raises(DatabaseError, match="audit events are append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(statement)
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditEvent.objects.filter(pk=trail[0].pk).update(result="failed")
    with pytest.raises(DatabaseError), transaction.atomic():
        trail[0].delete()
    assert AuditEvent.objects.get(pk=trail[0].pk).actor == "ops"


def test_the_filtered_trail_exports_as_csv_and_json(
    trail: list[AuditEvent], client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    body = b"".join(client.get("/audit/export.csv?action=rollout.").streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    assert [(r["actor"], r["action"], r["result"]) for r in rows] == [
        ("system:rollouts", "rollout.aborting", "ok"),
        ("viewer", "rollout.start", "denied"),
    ]
    body = b"".join(client.get("/audit/export.json?actor=ops").streaming_content).decode()
    (row,) = json.loads(body)
    assert (row["before"], row["after"], row["target"]) == (
        {"version": 1},
        {"version": 2},
        "pool:gpu:rag",
    )


def test_a_bad_time_filter_says_what_it_expects(
    trail: list[AuditEvent], client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    page = client.get("/audit/?since=yesterday").content.decode()
    assert "since: expected a date and time such as 2026-11-29T14:05 (UTC)" in page


def _guarded_urls() -> list[tuple[str, str]]:
    """Every URL whose view requires a permission, with sample arguments, and its action."""
    found = []

    def walk(patterns: list[object], prefix: str) -> None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern) and hasattr(pattern.callback, "required"):
                route = prefix + str(pattern.pattern)
                url = "/" + re.sub(
                    r"<(?:(\w+):)?\w+>", lambda m: "1" if m[1] == "int" else "x", route
                )
                found.append((url, pattern.callback.required[1]))

    walk(get_resolver().url_patterns, "")
    return found


def test_every_guarded_endpoint_refuses_and_records_exactly_one_event(
    client: Client, viewer: User
) -> None:
    guarded = _guarded_urls()
    assert len(guarded) >= 10  # registry, fleet and rollouts: the test must see them all
    client.force_login(viewer)
    for url, action in guarded:
        before = AuditEvent.objects.count()
        assert client.post(url).status_code == 403, url
        (event,) = AuditEvent.objects.all()[: AuditEvent.objects.count() - before]
        assert (event.actor, event.action, event.result, event.target) == (
            "viewer-user",
            action,
            "denied",
            url,
        )


def _public_functions(module: ModuleType) -> dict[str, Callable[..., object]]:
    return {
        name: value
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and name[0] != "_"
    }


# Functions of the services modules that are no person's action, and why.
NOT_ACTIONS = {
    "roles_sync": "setup that `setup_roles` runs at deploy time, like a migration",
    "node_poll": "the poller's observation; it records the node going down or up itself",
    "polled": "node_poll of a node read already",
    "stored": "a repository index as a node keeps it, no change",
    "joining_read": "read onto the node; its join writes it with the stage change, audited",
    "nodes_read_index": "an observation for the reconciler; a failure counts as a failed poll",
    "token_authenticate": "bookkeeping: when a token was last used",
    "token_digest": "a hash",
    "read_candidates": "a read",
    "repository_import": "reads a directory; candidates_import imports what it read",
    "archive_import": "unpacks an upload; candidates_import imports what it read",
    "node_import": "reads a node; candidates_import imports what it read",
    "user_role": "a read",
    "config_parse": "a check",
    "config_check": "a check",
    "config_problems": "a check",
    "compatibility_breaks": "a check",
    "reconcile_later": "enqueues the reconcile of a change its caller audits",
    "target_nodes": "a read: the nodes a change targets",
    "node_target": "names an event's target",
    "pool_target": "names an event's target",
    "rollout_propose": "a check: the dry run the rollout form previews",
    "active_rollout": "a read",
    "actor_name": "the trail itself",
    "audit_record": "the trail itself",
    "audit_event": "the trail itself",
    "audit_update": "the trail itself",
    "audit_append": "the trail itself",
    "fields_set": "the trail itself: a service's change of settings, recorded as its action",
    "audited": "the trail itself",
    "reference_version": "a read: which config a set is checked against",
    "parse_versions": "a parse of a person's text",
    "tier_serve": "a deployment_set (audited) of a pin's or the automation's, each audited",
}


def test_every_service_is_an_audited_action_and_is_in_a_table() -> None:
    """A new service fails here until it is audited and has a row in the tables below."""
    actions = {}
    for module in SERVICE_MODULES:
        for name, function in _public_functions(importlib.import_module(module)).items():
            assert hasattr(function, "audited") or name in NOT_ACTIONS, f"{module}.{name}"
            if hasattr(function, "audited"):
                actions[name] = function
    assert len(actions) >= 15
    assert (
        set(actions.values()) == FLEET_REGISTRY_SERVICES | ROLLOUT_SERVICES | DEGRADATION_SERVICES
    )


SERVICE_MODULES = [
    *(
        f"apps.{app}.services"
        for app in ("accounts", "audit", "quality", "performance", "registry", "rollouts")
    ),
    *(f"apps.fleet.services.{part}" for part in ("deployments", "nodes", "pools")),
    "apps.rollouts.proposals",
    "apps.approvals.services",
    "apps.degradation.services",
    "apps.fleet.polling",
    "apps.registry.imports",
    "apps.fleet.imports",
]
FLEET_REGISTRY_SERVICES = {
    accounts.user_ensure,
    accounts.token_create,
    accounts.token_revoke,
    pools.pool_role_set,
    nodes.node_register,
    deployments.deployment_set,
    deployments.deployment_remove,
    nodes.operation_request,
    nodes.node_adopt,
    pools.pool_set_queue,
    registry.version_create,
    registry.version_set_status,
    registry.model_set_budget,
    registry.model_set_fallback,
    registry.model_set_slo,
    imports.candidates_import,
    pools.pool_set_protected,
    pools.pool_set_discoverable,
    pools.pool_set_traffic,
    nodes.node_set_memory,
    nodes.node_clear,
    nodes.operation_override,
    pools.pool_set_rollback_window,
    registry.version_set_memory,
    approvals.approval_request,
    approvals.approval_approve,
    approvals.approval_reject,
    approvals.approval_withdraw,
    quality.evaluation_set_import,
    quality.evaluation_start,
    quality.synthetic_load_start,
    performance.perf_start,
    performance.search_start,  # started in tests/unit/test_search.py
}


def test_every_fleet_and_registry_service_records_one_event_refused_or_done(db: None) -> None:
    from apps.registry.codec import from_dict

    accounts.roles_sync()
    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(
        name="gpu-1",
        pool=pool,
        http_url="http://gpu-1:8000",
        index=[{"model": "other", "version": 1, "state": "READY", "reason": ""}],
    )
    model = Model.objects.create(name="rag")
    draft = ModelVersion.objects.create(model=model, version=1, config=CONFIG)
    ModelVersion.objects.create(model=model, version=2, config=CONFIG, status="published")
    tensor = {"data_type": "TYPE_FP32", "dims": [4]}
    good = from_dict(
        {
            **CONFIG,
            "name": "ocr",
            "input": [{"name": "IMAGE", **tensor}],
            "output": [{"name": "TEXT", **tensor}],
        }
    )
    deployed = lambda: Deployment.objects.get(pool=pool).pk  # noqa: E731
    ann = lambda: User.objects.get(username="ann")  # noqa: E731
    smoke = lambda: EvaluationSet.objects.get(name="smoke").pk  # noqa: E731
    perf_asked = {
        "model_name": "rag",
        "node": node,
        "concurrencies": (1, 2, 1),
        "requests": 100,
        "timeout_s": 60,
        "purpose": "a check",
        "actor": "ops",
    }
    evaluation_case = json.dumps(
        {
            "inputs": {"IMAGE": [1, 2, 3, 4]},
            "expect": {"TEXT": {"close_to": [1, 2, 3, 4], "abs": 0.1}},
        }
    )
    cases = [
        Case(
            accounts.user_ensure,
            "user.set_role",
            None,
            lambda: accounts.user_ensure(username="ann", password="pw", role=Role.VIEWER),
        ),
        Case(
            accounts.token_create,
            "token.create",
            lambda: accounts.token_create(user=ann(), name="", actor="ops"),
            lambda: accounts.token_create(user=ann(), name="ci", actor="ops"),
        ),
        Case(
            accounts.token_revoke,
            "token.revoke",
            lambda: accounts.token_revoke(token_id=0, actor="ops"),
            lambda: accounts.token_revoke(token_id=ApiToken.objects.get().pk, actor="ops"),
        ),
        Case(
            pools.pool_role_set,
            "user.set_pool_role",
            lambda: pools.pool_role_set(username="ann", pool_name="gpu", role="x", actor="ops"),
            lambda: pools.pool_role_set(
                username="ann", pool_name="gpu", role="release_manager", actor="ops"
            ),
        ),
        Case(
            nodes.node_register,
            "node.register",
            lambda: nodes.node_register(
                name="n", pool="gpu", http_url="ftp://x", grpc_url="", metrics_url="", actor="ops"
            ),
            lambda: nodes.node_register(
                name="n",
                pool="gpu",
                http_url="http://10.0.0.9:8000",
                grpc_url="",
                metrics_url="",
                actor="ops",
            ),
        ),
        Case(
            deployments.deployment_set,
            "deployment.set",
            lambda: deployments.deployment_set(model_name="rag", version=1, pool=pool, actor="ops"),
            lambda: deployments.deployment_set(model_name="rag", version=2, pool=pool, actor="ops"),
        ),
        Case(
            nodes.node_adopt,
            "node.adopt",
            lambda: nodes.node_adopt(node_id=node.pk, model_name="absent", actor="ops"),
            lambda: nodes.node_adopt(node_id=node.pk, model_name="other", actor="ops"),
        ),
        Case(
            pools.pool_set_queue,
            "pool.set_queue",
            lambda: pools.pool_set_queue(pool_name="gpu", queue="eu west", actor="ops"),
            lambda: pools.pool_set_queue(pool_name="gpu", queue="eu-west", actor="ops"),
        ),
        Case(
            nodes.operation_request,
            "operation.request_unload",
            lambda: nodes.operation_request(
                node_id=node.pk, kind="unload", model_name="rag", actor="ops"
            ),
            lambda: nodes.operation_request(
                node_id=node.pk, kind="unload", model_name="other", actor="ops"
            ),
        ),
        Case(
            deployments.deployment_remove,
            "deployment.remove",
            lambda: deployments.deployment_remove(deployment_id=0, actor="ops"),
            lambda: deployments.deployment_remove(deployment_id=deployed(), actor="ops"),
        ),
        Case(
            registry.version_create,
            "version.create",
            lambda: registry.version_create(
                model_name="ocr", config=from_dict({**CONFIG, "name": "nope"}), actor="ops"
            ),
            lambda: registry.version_create(model_name="ocr", config=good, actor="ops"),
        ),
        Case(
            registry.version_set_status,
            "version.set_status",
            lambda: registry.version_set_status(version_id=draft.pk, status="draft", actor="ops"),
            lambda: registry.version_set_status(
                version_id=draft.pk, status="published", actor="ops"
            ),
        ),
        Case(
            registry.model_set_budget,
            "model.set_budget",
            lambda: registry.model_set_budget(model_name="nope", latency_budget_ms=9, actor="ops"),
            lambda: registry.model_set_budget(model_name="rag", latency_budget_ms=90, actor="ops"),
        ),
        Case(
            registry.model_set_fallback,
            "model.set_fallback",
            lambda: registry.model_set_fallback(model_name="rag", version=9, actor="ops"),
            lambda: registry.model_set_fallback(model_name="rag", version=2, actor="ops"),
        ),
        Case(
            registry.model_set_slo,
            "model.set_slo",
            lambda: registry.model_set_slo(
                model_name="rag", availability=2.0, latency=None, actor="ops"
            ),
            lambda: registry.model_set_slo(
                model_name="rag", availability=0.99, latency=None, actor="ops"
            ),
        ),
    ]
    cases.append(
        Case(
            imports.candidates_import,
            "registry.import",
            None,
            lambda: imports.repository_import(path=REPOSITORY, actor="ops"),
        )
    )
    bob = accounts.user_ensure(username="bob", password="pw", role=Role.RELEASE_MANAGER)
    change = {"pool": "gpu", "model": "rag", "version": 2, "baseline": None}

    def pending() -> int:
        """A request of ann's, written directly: its own event is not the case's."""
        return Approval.objects.create(
            pool=pool,
            action="deployment.set",
            params=change,
            requested_by=ann(),
            expires_at=timezone.now() + timedelta(hours=1),
        ).pk

    cases += [
        Case(
            nodes.node_clear,
            "node.clear",
            lambda: nodes.node_clear(node_name="gpu-1", reason="restarted", actor="ops"),
            lambda: (
                Node.objects.filter(pk=node.pk).update(stage=Node.Stage.QUARANTINED),
                nodes.node_clear(node_name="gpu-1", reason="restarted", actor="ops"),
            ),
        ),
        Case(
            nodes.node_set_memory,
            "node.set_memory",
            lambda: nodes.node_set_memory(node_name="nope", limit_mb=1024, actor="ops"),
            lambda: nodes.node_set_memory(node_name="gpu-1", limit_mb=1024, actor="ops"),
        ),
        Case(
            nodes.operation_override,
            "operation.override",
            lambda: nodes.operation_override(operation_id=0, reason="fits", actor="ops"),
            lambda: nodes.operation_override(
                operation_id=Operation.objects.create(
                    node=node, kind="load", model_name="rag", failure="memory", requested_by="x"
                ).pk,
                reason="fits",
                actor="ops",
            ),
        ),
        Case(
            pools.pool_set_rollback_window,
            "pool.set_rollback_window",
            lambda: pools.pool_set_rollback_window(pool_name="gpu", seconds=-1, actor="ops"),
            lambda: pools.pool_set_rollback_window(pool_name="gpu", seconds=60, actor="ops"),
        ),
        Case(
            registry.version_set_memory,
            "version.set_memory",
            lambda: registry.version_set_memory(
                model_name="rag", version=9, memory_mb=512, actor="ops"
            ),
            lambda: registry.version_set_memory(
                model_name="rag", version=2, memory_mb=512, actor="ops"
            ),
        ),
        Case(
            pools.pool_set_protected,
            "pool.set_protected",
            lambda: pools.pool_set_protected(pool_name="nope", protected=True, actor="ops"),
            lambda: pools.pool_set_protected(pool_name="gpu", protected=True, actor="ops"),
        ),
        Case(
            pools.pool_set_discoverable,
            "pool.set_discoverable",
            lambda: pools.pool_set_discoverable(pool_name="nope", discoverable=True, actor="ops"),
            lambda: pools.pool_set_discoverable(pool_name="gpu", discoverable=True, actor="ops"),
        ),
        Case(
            pools.pool_set_traffic,
            "pool.set_traffic",
            lambda: pools.pool_set_traffic(pool_name="nope", traffic="", actor="ops"),
            lambda: pools.pool_set_traffic(pool_name="gpu", traffic="", min_serving=2, actor="ops"),
        ),
        Case(
            approvals.approval_request,
            "approval.request",
            None,
            lambda: approvals.approval_request(
                refused=ApprovalRequired("deployment.set", change, pool), actor=ann()
            ),
        ),
        Case(
            approvals.approval_approve,
            "approval.approve",
            lambda: approvals.approval_approve(approval_id=0, actor=bob),
            lambda: approvals.approval_approve(approval_id=Approval.objects.get().pk, actor=bob),
        ),
        Case(
            approvals.approval_reject,
            "approval.reject",
            lambda: approvals.approval_reject(approval_id=pending(), reason=" ", actor=bob),
            lambda: approvals.approval_reject(approval_id=pending(), reason="no", actor=bob),
        ),
        Case(
            approvals.approval_withdraw,
            "approval.withdraw",
            lambda: approvals.approval_withdraw(approval_id=0, actor=ann()),
            lambda: approvals.approval_withdraw(approval_id=pending(), actor=ann()),
        ),
        Case(
            quality.evaluation_set_import,
            "evaluation_set.import",
            lambda: quality.evaluation_set_import(
                model_name="ocr", name="smoke", text='{"inputs": {}}', actor="ops"
            ),
            lambda: quality.evaluation_set_import(
                model_name="ocr", name="smoke", text=evaluation_case, actor="ops"
            ),
        ),
        Case(
            quality.evaluation_start,
            "evaluation.start",
            lambda: quality.evaluation_start(set_id=smoke(), version=9, node=node, actor="ops"),
            lambda: quality.evaluation_start(set_id=smoke(), version=1, node=node, actor="ops"),
        ),
        Case(
            quality.synthetic_load_start,
            "synthetic_load.start",
            lambda: quality.synthetic_load_start(
                set_id=smoke(), nodes=[node], rps=0, seconds=60, actor="ops"
            ),
            lambda: quality.synthetic_load_start(
                set_id=smoke(), nodes=[node], rps=2, seconds=60, actor="ops"
            ),
        ),
        Case(
            performance.perf_start,
            "perf.start",
            lambda: performance.perf_start(version=9, **perf_asked),
            lambda: performance.perf_start(version=2, **perf_asked),
        ),
        Case(
            performance.search_start,
            "perf.search",
            lambda: performance.search_start(
                pipeline="rag", pool_name="gpu", step="x", concurrency=4, requests=99, actor="ops"
            ),
            None,
        ),
    ]
    assert {case.service for case in cases} == FLEET_REGISTRY_SERVICES
    assert_one_event_each(cases)


def test_an_event_carries_the_id_of_the_request_it_was_written_for(
    client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    url, _ = _guarded_urls()[0]
    response = client.post(url, headers={"X-Request-ID": "ci-run-42.7"})
    assert response["X-Request-ID"] == "ci-run-42.7"  # so a user can quote it
    assert AuditEvent.objects.filter(request_id="ci-run-42.7").get().result == "denied"
    page = client.get("/audit/", {"request": "ci-run-42.7"}).content.decode()
    assert page.count('href="?request=ci-run-42.7"') == 1
    assert "ci-run-42.7" in client.get("/audit/export.csv").getvalue().decode()
    # What a proxy must not smuggle into the trail is replaced by an id of our own.
    for hostile in ("a b", "<script>", "x" * 65):
        response = client.post(url, headers={"X-Request-ID": hostile})
        assert re.fullmatch(r"[0-9a-f]{32}", response["X-Request-ID"]), hostile
        assert AuditEvent.objects.first().request_id == response["X-Request-ID"]  # type: ignore[union-attr]
    assert not client.get("/audit/", {"request": "nobody"}).context["page"].object_list


def test_an_action_not_named_in_the_registry_is_refused_and_nothing_is_written(db: None) -> None:
    with pytest.raises(ValueError, match=r"'rollout\.stepped' is not an audit action"):
        audit_record(actor="ops", action="rollout.stepped", target="rollout:1:rag")
    assert not AuditEvent.objects.exists()


def test_an_update_and_its_event_are_written_together_or_not_at_all(db: None) -> None:
    """A worker's end of an operation and its event (and the claim of its next operation): one
    statement on PostgreSQL (a release writes thousands), written as `audit_record` writes it,
    and no event nor claim when no row changed."""
    pool = NodePool.objects.create(name="p")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://n1:8000")
    op = Operation.objects.create(node=node, kind="load", model_name="rag", status="running")
    update = "UPDATE fleet_operation SET status = %s WHERE id = %s AND status = %s"
    succeeded = (update, ("succeeded", op.pk, "running"))
    failed = (update, ("failed", op.pk, "running"))
    token = REQUEST_ID.set("req-7")  # as the request that changed the desired state set it
    try:
        event = audit_event(
            actor="system:reconciler",
            action="operation.load",
            target="node:n1:rag",
            after={"versions": [2]},
            message="ok at last",
        )
    finally:
        REQUEST_ID.reset(token)
    with CaptureQueriesContext(connection) as statements:
        assert audit_update(succeeded, event) == (1, 0)
    if connection.vendor == "postgresql":
        assert len(statements) == 1
    op.refresh_from_db()
    written = AuditEvent.objects.get()
    assert (op.status, written.action, written.actor, written.user_id) == (
        "succeeded",
        "operation.load",
        "system:reconciler",
        None,
    )
    assert (written.target_type, written.target_name, written.target_model) == ("node", "n1", "rag")
    assert (written.after, written.message, written.request_id) == (
        {"versions": [2]},
        "ok at last",
        "req-7",
    )
    assert written.created_at is not None
    # Taken over meanwhile: nothing changed, so nothing is recorded.
    again = audit_event(actor="system:reconciler", action="operation.load", target="node:n1:rag")
    later = Operation.objects.create(node=node, kind="load", model_name="emb", status="queued")
    claim = (update, ("running", later.pk, "queued"))
    assert audit_update(failed, again, claim) == (0, 0)
    assert AuditEvent.objects.count() == 1
    assert Operation.objects.get(pk=op.pk).status == "succeeded"
    assert Operation.objects.get(pk=later.pk).status == "queued"  # nor the update after it
    # Changed, with the update after it: in the same statement on PostgreSQL.
    Operation.objects.filter(pk=op.pk).update(status="running")
    with CaptureQueriesContext(connection) as statements:
        assert audit_update(succeeded, again, claim) == (1, 1)
    if connection.vendor == "postgresql":
        assert len(statements) == 1
    assert (
        AuditEvent.objects.count() == 2 and Operation.objects.get(pk=later.pk).status == "running"
    )


def test_every_action_the_api_refuses_under_is_in_the_registry() -> None:
    """An endpoint records a refusal under the action its auth names (the views' are recorded
    by the test above): each must be an action the trail's readers know."""
    named = {
        auth.action
        for router in (router for _, router in api._routers)
        for path in router.path_operations.values()
        for operation in path.operations
        for auth in operation.auth_callbacks
        if isinstance(auth, Token) and auth.action
    }
    assert len(named) >= 10 and named <= set(ACTIONS), named - set(ACTIONS)
