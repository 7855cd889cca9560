from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.pools import pool_set_discoverable


class Command(BaseCommand):
    help = (
        "Open a pool to discovery (or close it): nodes that Prometheus lists with its label join "
        "it by themselves. Audited; through the API, a protected pool waits for approval."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("discoverable", choices=["on", "off"])

    def handle(self, *args: object, pool: str, discoverable: str, **_: object) -> None:
        try:
            pool_set_discoverable(
                pool_name=pool,
                discoverable=discoverable == "on",
                actor="system:set_pool_discoverable",
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{pool}: {'open to' if discoverable == 'on' else 'closed to'} discovery")
