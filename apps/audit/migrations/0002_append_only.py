"""The audit trail is append-only in the database itself: on PostgreSQL a trigger rejects every
UPDATE and DELETE of an event, whatever client sends it. (TRUNCATE, which only an owner can run,
stays possible: test databases are emptied with it.) Users with events cannot be deleted; they are
deactivated."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

REJECT = """
CREATE FUNCTION audit_event_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'audit events are append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER audit_event_append_only
    BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_event_append_only();
"""
ALLOW = """
DROP TRIGGER audit_event_append_only ON audit_auditevent;
DROP FUNCTION audit_event_append_only();
"""


def reject(apps: object, schema_editor: object) -> None:
    if schema_editor.connection.vendor == "postgresql":  # type: ignore[attr-defined]
        schema_editor.execute(REJECT, params=None)  # type: ignore[attr-defined]


def allow(apps: object, schema_editor: object) -> None:
    if schema_editor.connection.vendor == "postgresql":  # type: ignore[attr-defined]
        schema_editor.execute(ALLOW, params=None)  # type: ignore[attr-defined]


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="user",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.RunPython(reject, allow),
    ]
