from typing import Any

from django.core.management.commands import flush
from django.db import connections

TRIGGERS = "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s"


class Command(flush.Command):
    """Django's flush, which empties the audit trail too. On PostgreSQL it runs TRUNCATE, an
    owner's statement that the append-only trigger lets pass; on SQLite it deletes every row, so
    the trail's triggers (migration 0006) stand aside while it runs and come back after."""

    def handle(self, **options: Any) -> None:
        connection = connections[options["database"]]
        if connection.vendor != "sqlite":
            return super().handle(**options)
        with connection.cursor() as cursor:
            cursor.execute(TRIGGERS, ["audit_auditevent"])
            triggers = cursor.fetchall()
            for name, _ in triggers:
                cursor.execute(f'DROP TRIGGER "{name}"')
        try:
            return super().handle(**options)
        finally:
            with connection.cursor() as cursor:
                for _, sql in triggers:
                    cursor.execute(sql)
