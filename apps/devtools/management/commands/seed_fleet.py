from django.core.management.base import BaseCommand, CommandParser

from apps.devtools.seed import Size, seed_fleet


class Command(BaseCommand):
    help = (
        "Add a big fleet's worth of data (500 nodes in 10 pools, 50 models of 10 versions, "
        "10,000 operations, 20 rollouts, 100,000 audit events by default) to try the pages at "
        "scale. Nothing talks to Triton: the nodes' addresses are made up."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        for field, default in Size().__dict__.items():
            parser.add_argument(f"--{field}", type=int, default=default)
        parser.add_argument("--prefix", default="", help="start of every name (to seed twice)")

    def handle(self, *args: object, prefix: str, **options: int) -> None:
        size = Size(**{field: options[field] for field in Size().__dict__})
        seed_fleet(size=size, prefix=prefix)
        self.stdout.write(f"seeded {size}")
