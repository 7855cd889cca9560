import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.registry.imports import repository_import


class Command(BaseCommand):
    help = "Validate every model of a Triton model repository together and import the valid ones."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", type=Path)
        parser.add_argument("--dry-run", action="store_true", help="validate only, store nothing")
        parser.add_argument("--json", action="store_true", help="one JSON object per model")

    def handle(
        self, *args: object, path: Path, dry_run: bool, json: bool, **options: object
    ) -> None:
        results = repository_import(path=path, actor="system:import_repository", dry_run=dry_run)
        for result in results:
            if json:
                self.stdout.write(_json.dumps(result.as_json()))
                continue
            verdict = "ok" if result.ok else "INVALID"
            stored = f", imported {result.imported}" if result.imported else ""
            self.stdout.write(f"{result.model}: {verdict} versions {result.versions}{stored}")
            for error in result.errors:
                self.stdout.write(f"  {error}")
        bad = [r.model for r in results if not r.ok]
        if bad:
            raise CommandError(f"{len(bad)} invalid model(s): {', '.join(bad)}")


_json = json
