import contextlib
import csv
import io
import json
import re
from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool
from apps.registry.models import Model, ModelVersion

CONFIG = {"name": "rag", "backend": "python", "max_batch_size": 8}


@pytest.fixture
def trail(db: None) -> list[AuditEvent]:
    return [
        audit_record(
            actor="ops",
            action="deployment.set",
            target="pool:gpu:rag",
            before={"version": 1},
            after={"version": 2},
        ),
        audit_record(
            actor="system:rollouts",
            action="rollout.aborting",
            target="rollout:7:rag",
            message="failure: p99 | above\nthreshold",
        ),
        audit_record(
            actor="viewer", action="rollout.start", target="/rollouts/new/", result="denied"
        ),
    ]


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


def test_the_timeline_sums_up_and_exports_a_markdown_report(
    trail: list[AuditEvent], client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    page = client.get("/audit/timeline/?window=1h").content.decode()
    assert "<strong>pool:gpu:rag</strong>: v1 → v2" in page
    report = client.get("/audit/timeline/report.md?window=1h")
    text = report.content.decode()
    assert report["Content-Type"].startswith("text/markdown")
    assert "- `pool:gpu:rag`: v1 -> v2" in text
    assert (
        "| system:rollouts | `rollout.aborting` | `rollout:7:rag` | ok | failure: p99 \\| above threshold |"
        in text
    )
    assert "/audit/timeline/?start=" in text  # the permalink to the same window


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


def _service_calls() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """Each mutating service with (action, a call it refuses, a call it accepts)."""
    from apps.fleet import services as fleet
    from apps.registry import services as registry
    from apps.registry.codec import from_dict

    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(name="gpu-1", pool=pool, http_url="http://gpu-1:8000")
    model = Model.objects.create(name="rag")
    draft = ModelVersion.objects.create(model=model, version=1, config=CONFIG)
    ModelVersion.objects.create(model=model, version=2, config=CONFIG, status="released")
    tensor = {"data_type": "TYPE_FP32", "dims": [4]}
    good = from_dict(
        {
            **CONFIG,
            "name": "ocr",
            "input": [{"name": "IMAGE", **tensor}],
            "output": [{"name": "TEXT", **tensor}],
        }
    )
    return [
        (
            "node.register",
            lambda: fleet.node_register(
                name="n", pool="gpu", http_url="ftp://x", grpc_url="", metrics_url="", actor="ops"
            ),
            lambda: fleet.node_register(
                name="n",
                pool="gpu",
                http_url="http://n:8000",
                grpc_url="",
                metrics_url="",
                actor="ops",
            ),
        ),
        (
            "deployment.set",
            lambda: fleet.deployment_set(model_name="rag", version=1, pool=pool, actor="ops"),
            lambda: fleet.deployment_set(model_name="rag", version=2, pool=pool, actor="ops"),
        ),
        (
            "operation.request_unload",
            lambda: fleet.operation_request(
                node_id=node.pk, kind="unload", model_name="rag", actor="ops"
            ),
            lambda: fleet.operation_request(
                node_id=node.pk, kind="unload", model_name="other", actor="ops"
            ),
        ),
        (
            "registry.version_create",
            lambda: registry.version_create(
                model_name="ocr", config=from_dict({**CONFIG, "name": "nope"}), actor="ops"
            ),
            lambda: registry.version_create(model_name="ocr", config=good, actor="ops"),
        ),
        (
            "registry.version_status",
            lambda: registry.version_set_status(version_id=draft.pk, status="draft", actor="ops"),
            lambda: registry.version_set_status(
                version_id=draft.pk, status="released", actor="ops"
            ),
        ),
        (
            "registry.fallback_set",
            lambda: registry.model_set_fallback(model_name="rag", version=9, actor="ops"),
            lambda: registry.model_set_fallback(model_name="rag", version=2, actor="ops"),
        ),
    ]


def test_every_mutating_service_records_one_event_refused_or_done(db: None) -> None:
    for action, refused, accepted in _service_calls():
        for call, result in ((refused, "failed"), (accepted, "ok")):
            before = AuditEvent.objects.count()
            with contextlib.suppress(Exception):
                call()
            new = list(AuditEvent.objects.all()[: AuditEvent.objects.count() - before])
            assert [(e.action, e.result) for e in new] == [(action, result)], action
            if result == "failed":
                assert new[0].message, f"{action}: a refusal says why"
