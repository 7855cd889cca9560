from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.pools import pool_set_queue


class Command(BaseCommand):
    help = (
        "Route pools to Celery queues, POOL=QUEUE (POOL= for the default queue): a worker started "
        "with `-Q QUEUE` then drives that pool's nodes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("routes", nargs="+", metavar="POOL=QUEUE")

    def handle(self, *args: object, routes: list[str], **options: object) -> None:
        for item in routes:
            pool, sign, queue = item.partition("=")
            if not sign:
                raise CommandError(f"{item!r}: expected POOL=QUEUE, e.g. eu-west=eu-west")
            try:
                pool_set_queue(pool_name=pool, queue=queue, actor="system:set_pool_queue")
            except FleetError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(f"{pool}: {'queue ' + queue if queue else 'the default queue'}")
