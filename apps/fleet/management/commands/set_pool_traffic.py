from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.pools import pool_set_traffic


class Command(BaseCommand):
    help = (
        "Put a pool behind HAProxy: rollouts then give percent steps their exact share by "
        "server weight, and nodes are drained before every load. `--none` undoes it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        way = parser.add_mutually_exclusive_group(required=True)
        way.add_argument("--haproxy", metavar="ADDRESS", help="runtime API: host:port or socket")
        way.add_argument("--none", action="store_true", help="shares by node count again")
        parser.add_argument(
            "--backends",
            default="triton_http,triton_grpc:grpc",
            help="the HAProxy backends whose servers are the pool's nodes (comma-separated; "
            "`name:grpc`: its servers are their gRPC endpoints)",
        )
        parser.add_argument("--min-serving", type=int, default=1)
        parser.add_argument("--warmup-requests", type=int, default=5)
        parser.add_argument("--drain-timeout", type=int, default=30, metavar="SECONDS")

    def handle(self, *args: object, **options: object) -> None:
        try:
            pool = pool_set_traffic(
                pool_name=options["pool"],  # type: ignore[arg-type]
                traffic="" if options["none"] else "haproxy",
                runtime=options["haproxy"] or "",  # type: ignore[arg-type]
                backends=str(options["backends"]).split(","),
                min_serving=options["min_serving"],  # type: ignore[arg-type]
                warmup_requests=options["warmup_requests"],  # type: ignore[arg-type]
                drain_timeout_s=options["drain_timeout"],  # type: ignore[arg-type]
                actor="system:set_pool_traffic",
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        where = f"HAProxy at {pool.traffic_runtime}" if pool.traffic else "no balancer"
        self.stdout.write(f"{pool.name}: {where}; keeps {pool.min_serving} nodes serving")
