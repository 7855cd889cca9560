from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.pools import pool_set_protected


class Command(BaseCommand):
    help = (
        "Protect a pool (or stop): a person's deployments, promotions and pool-wide rollbacks "
        "there wait for a second person's approval. Audited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("protected", choices=["on", "off"])

    def handle(self, *args: object, pool: str, protected: str, **_: object) -> None:
        try:
            pool_set_protected(
                pool_name=pool, protected=protected == "on", actor="system:set_pool_protected"
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{pool}: {'protected' if protected == 'on' else 'not protected'}")
