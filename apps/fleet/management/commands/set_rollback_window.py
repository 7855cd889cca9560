from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.pools import pool_set_rollback_window


class Command(BaseCommand):
    help = (
        "How long, after a promotion, a pool keeps the release before loaded beside the new one "
        "(not served): a rollback inside that window only narrows. 0: not at all. Audited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("seconds", type=int)

    def handle(self, *args: object, pool: str, seconds: int, **_: object) -> None:
        try:
            pool_set_rollback_window(
                pool_name=pool, seconds=seconds, actor="system:set_rollback_window"
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{pool}: rollback window {seconds} s")
