"""An event's target taken apart into columns (AuditEvent.target_parts), for the events already
written too. The trail is append-only: its trigger is set aside for this one UPDATE and put back
(on SQLite, adding the columns rebuilt the table, which dropped its triggers: 0006)."""

from django.conf import settings
from django.db import migrations, models

from apps.audit.models import target_parts

PG_TRIGGER = """
CREATE TRIGGER audit_event_append_only
    BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_event_append_only()
"""
# What target_parts does, in one statement over the whole trail.
PG_BACKFILL = r"""
UPDATE audit_auditevent SET
    target_type = split_part(target, ':', 1),
    target_name = CASE WHEN split_part(target, ':', 1) IN ('pool', 'node', 'rollout', 'model')
        THEN split_part(target, ':', 2) ELSE substr(target, strpos(target, ':') + 1) END,
    target_model = CASE
        WHEN split_part(target, ':', 1) = 'model' THEN split_part(target, ':', 2)
        WHEN split_part(target, ':', 1) IN ('pool', 'node', 'rollout')
            THEN regexp_replace(target, '^[^:]*:[^:]*:?', '')
        ELSE '' END
WHERE target ~ '^[A-Za-z_][A-Za-z0-9_]*:'
"""
SQLITE_TRIGGERS = [
    f"""
    CREATE TRIGGER audit_event_append_only_{op.lower()}
    BEFORE {op} ON audit_auditevent
    BEGIN
        SELECT RAISE(ABORT, 'audit events are append-only: {op} refused');
    END
    """
    for op in ("UPDATE", "DELETE")
]


def backfill(apps: object, schema_editor: object) -> None:
    execute = schema_editor.execute  # type: ignore[attr-defined]
    if schema_editor.connection.vendor == "postgresql":  # type: ignore[attr-defined]
        execute("DROP TRIGGER audit_event_append_only ON audit_auditevent", params=None)
        execute(PG_BACKFILL, params=None)
        execute(PG_TRIGGER, params=None)
        return
    for op in ("update", "delete"):
        execute(f"DROP TRIGGER IF EXISTS audit_event_append_only_{op}", params=None)
    events = apps.get_model("audit", "AuditEvent")  # type: ignore[attr-defined]
    changed = []
    for event in events.objects.only("id", "target").iterator(chunk_size=2000):
        for name, value in target_parts(event.target).items():
            setattr(event, name, value)
        changed.append(event)
    events.objects.bulk_update(changed, ["target_type", "target_name", "target_model"], 2000)
    for statement in SQLITE_TRIGGERS:
        execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0006_append_only_on_sqlite"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="target_model",
            field=models.CharField(blank=True, db_default="", db_index=True, max_length=150),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="target_name",
            field=models.CharField(blank=True, db_default="", max_length=200),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="target_type",
            field=models.CharField(blank=True, db_default="", max_length=30),
        ),
        migrations.AddIndex(
            model_name="auditevent",
            index=models.Index(fields=["target_type", "target_name"], name="audit_target"),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
