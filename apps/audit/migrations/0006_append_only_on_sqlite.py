"""The audit trail is append-only on SQLite too: triggers abort every UPDATE and DELETE of an
event, as the PostgreSQL trigger (0002) does. `manage.py flush`, which empties every table (the
tests' transactional cleanup), sets them aside while it runs (apps/audit/management/commands/
flush.py), as TRUNCATE passes the PostgreSQL one. A later migration that rebuilds this table on
SQLite (Django copies it into a new one) drops them: it must create them again."""

from django.db import migrations

REJECT = [
    f"""
    CREATE TRIGGER audit_event_append_only_{op.lower()}
    BEFORE {op} ON audit_auditevent
    BEGIN
        SELECT RAISE(ABORT, 'audit events are append-only: {op} refused');
    END
    """
    for op in ("UPDATE", "DELETE")
]
ALLOW = [f"DROP TRIGGER audit_event_append_only_{op}" for op in ("update", "delete")]


def reject(apps: object, schema_editor: object) -> None:
    if schema_editor.connection.vendor == "sqlite":  # type: ignore[attr-defined]
        for statement in REJECT:
            schema_editor.execute(statement, params=None)  # type: ignore[attr-defined]


def allow(apps: object, schema_editor: object) -> None:
    if schema_editor.connection.vendor == "sqlite":  # type: ignore[attr-defined]
        for statement in ALLOW:
            schema_editor.execute(statement, params=None)  # type: ignore[attr-defined]


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0005_partition_by_month"),
    ]

    operations = [
        migrations.RunPython(reject, allow),
    ]
