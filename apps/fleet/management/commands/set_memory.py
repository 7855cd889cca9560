from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.services.nodes import node_set_memory
from apps.registry.services import RegistryError, version_set_memory

ACTOR = "system:set_memory"


class Command(BaseCommand):
    help = (
        "Memory-aware loads: a node's memory limit (--node NODE --limit-mb N, 0 for none), or a "
        "version's declared estimate until one is measured (--model-version MODEL:VERSION --mb N)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--node")
        parser.add_argument("--limit-mb", type=int)
        parser.add_argument("--model-version", metavar="MODEL:VERSION")
        parser.add_argument("--mb", type=int)

    def handle(self, *args: object, **options: object) -> None:
        node, limit = options["node"], options["limit_mb"]
        version, mb = options["model_version"], options["mb"]
        try:
            if isinstance(node, str) and isinstance(limit, int):
                node_set_memory(node_name=node, limit_mb=limit or None, actor=ACTOR)
                self.stdout.write(f"{node}: memory limit {limit or 'none'} MiB")
            elif isinstance(version, str) and isinstance(mb, int):
                name, _, number = version.partition(":")
                if not number.isdecimal():
                    raise CommandError(f"{version!r}: expected MODEL:VERSION, e.g. generator:2")
                version_set_memory(
                    model_name=name, version=int(number), memory_mb=mb or None, actor=ACTOR
                )
                self.stdout.write(f"{version}: declared {mb or 'no'} MiB")
            else:
                raise CommandError("give --node with --limit-mb, or --model-version with --mb")
        except (FleetError, RegistryError) as exc:
            raise CommandError(str(exc)) from exc
