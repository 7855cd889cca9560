from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.nodes import node_register


class Command(BaseCommand):
    help = (
        "Add a Triton node to a pool (the pool is created with its first node), or change its "
        "addresses. Audited; running it again with the same addresses changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the node's name; Prometheus targets carry it as `node`")
        parser.add_argument("pool")
        parser.add_argument("http_url", help="Triton's HTTP endpoint, e.g. http://gpu-1:8000")
        parser.add_argument("--grpc", default="", help="host:port of Triton's gRPC endpoint")
        parser.add_argument("--metrics-url", default="", help="e.g. http://gpu-1:8002/metrics")

    def handle(self, *args: object, **options: str) -> None:
        try:
            node = node_register(
                name=options["name"],
                pool=options["pool"],
                http_url=options["http_url"],
                grpc_url=options["grpc"],
                metrics_url=options["metrics_url"],
                actor="system:register_node",
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{node.name} in pool {options['pool']}: {node.http_url}")
