"""An event's target is taken apart into columns once, when it is written (and, by migration
0007, for the events written before), so that the charts, suspects and timeline select by
column instead of parsing strings."""

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from apps.audit.models import AuditEvent, target_parts
from apps.audit.services import audit_record

PARTS = ("target_type", "target_name", "target_model")
CASES = [
    ("pool:demo:rag_pipeline", ("pool", "demo", "rag_pipeline")),
    ("node:demo-1", ("node", "demo-1", "")),
    ("node:demo-1:embedder", ("node", "demo-1", "embedder")),
    ("rollout:7:rag_pipeline", ("rollout", "7", "rag_pipeline")),
    ("model:rag_pipeline:v2", ("model", "rag_pipeline", "rag_pipeline")),
    ("model:rag_pipeline", ("model", "rag_pipeline", "rag_pipeline")),
    ("incident:3", ("incident", "3", "")),
    ('alert:{}:{alertname="P99"}', ("alert", '{}:{alertname="P99"}', "")),
    ("/rollouts/new/", ("", "", "")),
    ("registry", ("", "", "")),
]


@pytest.mark.parametrize(("target", "parts"), CASES)
def test_a_target_is_taken_apart_once(target: str, parts: tuple[str, str, str]) -> None:
    assert tuple(target_parts(target)[name] for name in PARTS) == parts


@pytest.mark.django_db
def test_an_event_is_written_with_its_target_parts() -> None:
    audit_record(actor="ops", action="deployment.set", target="pool:demo:rag_pipeline")
    assert AuditEvent.objects.filter(
        target_type="pool", target_name="demo", target_model="rag_pipeline"
    ).exists()


def _insert(target: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO audit_auditevent (created_at, actor, action, target, before, after,"
            " result, message, request_id, via) VALUES (%s, 'ops', 'deployment.set', %s,"
            " '{}', '{}', 'ok', '', '', '')",
            [timezone.now(), target],
        )


@pytest.mark.django_db(transaction=True)
def test_the_migration_takes_apart_the_events_already_written_and_the_trail_stays_append_only(
    migrator: MigrationExecutor,
) -> None:
    before, after = [("audit", "0006_append_only_on_sqlite")], [("audit", "0007_target_parts")]
    migrator.migrate(before)
    for target, _ in CASES:
        _insert(target)
    MigrationExecutor(connection).migrate(after)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT target, {', '.join(PARTS)} FROM audit_auditevent")  # noqa: S608
        found = {row[0]: tuple(row[1:]) for row in cursor.fetchall()}
    assert found == dict(CASES)
    for statement in ("UPDATE audit_auditevent SET actor = 'x'", "DELETE FROM audit_auditevent"):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(statement)
