from datetime import date, datetime
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.audit.partitions import ArchiveError, audit_archive


def _month(text: str) -> date:
    try:
        return datetime.strptime(text, "%Y-%m").date()
    except ValueError:
        raise CommandError(f"--month {text!r}: expected a month such as 2026-01") from None


class Command(BaseCommand):
    help = (
        "Export a past month of the audit trail to JSON Lines, then detach its partition "
        "(PostgreSQL; run as the owner: DATABASE_AS_OWNER=true). The detached table stays, "
        "unless --drop, until you drop it yourself."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--month", required=True, help="YYYY-MM, before the current month")
        parser.add_argument("--out", required=True, type=Path, help="the .jsonl file to write")
        parser.add_argument(
            "--drop", action="store_true", help="drop the partition once exported and detached"
        )

    def handle(self, *args: object, month: str, out: Path, drop: bool, **options: object) -> None:
        try:
            rows = audit_archive(
                month=_month(month), out=out, drop=drop, actor="system:audit_archive"
            )
        except ArchiveError as exc:
            raise CommandError(str(exc)) from None
        done = "dropped" if drop else "detached (drop it once the file is safe)"
        self.stdout.write(f"{month}: {rows} events written to {out}; partition {done}")
