"""`request_id` and `target_model` indexed without the LIKE twin (varchar_pattern_ops) that a
CharField's db_index adds on PostgreSQL: both are looked up by equality only, and every event
written paid for two indexes no query used.

The trail is the largest table and written all the time, so nothing is rebuilt: on PostgreSQL
the plain indexes are renamed to the models' names and the twins dropped. On SQLite (no twins)
the index is made again under its new name; an AlterField there would rebuild the table, and
with it drop the append-only triggers (0006)."""

from django.conf import settings
from django.db import migrations, models

# (Django's name for the field's index, the model's name for it now, the column)
RENAMED = [
    ("audit_auditevent_request_id_b6fdcfa6", "audit_request", "request_id"),
    ("audit_auditevent_target_model_379ba1fc", "audit_target_model", "target_model"),
]


def forwards(apps: object, schema_editor: object) -> None:
    execute = schema_editor.execute  # type: ignore[attr-defined]
    for old, new, column in RENAMED:
        if schema_editor.connection.vendor == "postgresql":  # type: ignore[attr-defined]
            execute(f'ALTER INDEX "{old}" RENAME TO "{new}"', params=None)
            execute(f'DROP INDEX IF EXISTS "{old}_like"', params=None)
        else:
            execute(f'DROP INDEX "{old}"', params=None)
            execute(f'CREATE INDEX "{new}" ON "audit_auditevent" ("{column}")', params=None)


def backwards(apps: object, schema_editor: object) -> None:
    execute = schema_editor.execute  # type: ignore[attr-defined]
    for old, new, column in RENAMED:
        if schema_editor.connection.vendor == "postgresql":  # type: ignore[attr-defined]
            execute(f'ALTER INDEX "{new}" RENAME TO "{old}"', params=None)
            execute(
                f'CREATE INDEX "{old}_like" ON "audit_auditevent" ("{column}" varchar_pattern_ops)',
                params=None,
            )
        else:
            execute(f'DROP INDEX "{new}"', params=None)
            execute(f'CREATE INDEX "{old}" ON "audit_auditevent" ("{column}")', params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0007_target_parts"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="auditevent",
                    name="request_id",
                    field=models.CharField(blank=True, max_length=64),
                ),
                migrations.AlterField(
                    model_name="auditevent",
                    name="target_model",
                    field=models.CharField(blank=True, db_default="", max_length=150),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["target_model"], name="audit_target_model"),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["request_id"], name="audit_request"),
                ),
            ],
            database_operations=[migrations.RunPython(forwards, backwards)],
        )
    ]
