"""The audit trail by month, on PostgreSQL (migration 0005): partitions made ahead, and a past
month archived to JSON Lines and detached. The trail is kept forever; archiving moves a month
out of the live table, never rewrites it. SQLite keeps one plain table: nothing to do there."""

import json
import os
from datetime import UTC, date, datetime
from pathlib import Path

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record

TABLE = AuditEvent._meta.db_table
MONTHS_AHEAD = 3


class ArchiveError(Exception):
    pass


def partitioned() -> bool:
    return connection.vendor == "postgresql"


def partition_name(month: date) -> str:
    return f"{TABLE}_p{month:%Y_%m}"


def audit_partitions_ensure(*, months: int = MONTHS_AHEAD) -> int:
    """This month's partition and the next `months`, those missing: how many were made. Harmless
    to repeat, and run by the application's role: the database function does it as the owner."""
    if not partitioned():
        return 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT audit_partitions_ensure(%s)", [months])
        return int(cursor.fetchone()[0])


def audit_partitions() -> list[str]:
    """The partitions attached now, oldest first, DEFAULT last."""
    if not partitioned():
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY c.relname = %s, c.relname",
            [TABLE, f"{TABLE}_default"],
        )
        return [name for (name,) in cursor.fetchall()]


def _next(month: date) -> date:
    return date(month.year + month.month // 12, month.month % 12 + 1, 1)


def _start(month: date) -> datetime:
    return datetime(month.year, month.month, 1, tzinfo=UTC)


def _row(event: AuditEvent) -> str:
    fields = AuditEvent._meta.concrete_fields
    return json.dumps(
        {field.attname: field.value_from_object(event) for field in fields}, cls=DjangoJSONEncoder
    )


def audit_archive(*, month: date, out: Path, drop: bool, actor: str) -> int:
    """Write a past month's events to `out` (JSON Lines, oldest first), then detach its
    partition, dropping it with `drop`; returns how many events. The export runs first, with
    nothing locked; the detach, which holds the trail's lock for a moment, commits only if the
    partition holds exactly the rows written, so a failure anywhere leaves the month attached
    (and no file at `out`). Needs the owner's role (DETACH, DROP)."""
    month = month.replace(day=1)
    if not partitioned():
        raise ArchiveError("the audit trail is partitioned by month on PostgreSQL only")
    if month >= timezone.now().date().replace(day=1):
        raise ArchiveError(f"{month:%Y-%m} is not over yet: only a past month is archived")
    name = partition_name(month)
    if name not in audit_partitions():
        raise ArchiveError(
            f"{month:%Y-%m} has no attached partition ({name}): archived already, or its events "
            "are in the default partition"
        )
    if out.exists():
        raise ArchiveError(f"{out} exists: archives are never overwritten")
    partial = out.with_name(out.name + ".partial")
    rows = 0
    with partial.open("w", encoding="utf-8") as file:
        # The month's range reads its partition only: the DEFAULT one cannot hold its rows.
        events = AuditEvent.objects.filter(
            created_at__gte=_start(month), created_at__lt=_start(_next(month))
        )
        for event in events.order_by("created_at", "id").iterator(chunk_size=2000):
            file.write(_row(event) + "\n")
            rows += 1
        file.flush()
        os.fsync(file.fileno())
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
        cursor.execute(f'SELECT count(*) FROM "{name}"')  # noqa: S608  # a name made of a date
        held = cursor.fetchone()[0]
        if held != rows:
            partial.unlink()
            raise ArchiveError(f"{name} holds {held} events, {rows} were written: left attached")
        partial.rename(out)
        if drop:
            cursor.execute(f'DROP TABLE "{name}"')
        audit_record(
            actor=actor,
            action="audit.archive",
            target=f"audit:{month:%Y-%m}",
            after={"events": rows, "file": str(out), "partition": name, "dropped": drop},
        )
    return rows
