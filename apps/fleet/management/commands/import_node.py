import json

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.imports import node_import
from apps.fleet.models import Node
from apps.fleet.triton import TritonError


class Command(BaseCommand):
    help = "Import the models a live node reports READY (index and config) into the registry."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node", help="a registered node's name")
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: object, node: str, dry_run: bool, **options: object) -> None:
        found = Node.objects.filter(name=node).first()
        if found is None:
            raise CommandError(f"no node named {node!r}; `devfleet status` lists them")
        try:
            results = node_import(node=found, actor="system:import_node", dry_run=dry_run)
        except TritonError as exc:
            raise CommandError(str(exc)) from None
        for result in results:
            if options["json"]:
                self.stdout.write(json.dumps(result.as_json()))
            else:
                self.stdout.write(
                    f"{result.model}: {'ok' if result.ok else 'INVALID'} {result.versions}"
                )
                for error in result.errors:
                    self.stdout.write(f"  {error}")
        if any(not r.ok for r in results):
            raise CommandError("some models are invalid")
