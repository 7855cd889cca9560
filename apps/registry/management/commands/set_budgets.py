from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.registry.models import Model
from apps.registry.services import model_set_budget


class Command(BaseCommand):
    help = "Set P99 latency budgets, MODEL=MS: per step for step models, end to end for ensembles."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("budgets", nargs="+", metavar="MODEL=MS")

    def handle(self, *args: object, budgets: list[str], **options: object) -> None:
        for item in budgets:
            name, _, ms = item.partition("=")
            if not ms.isdecimal():
                raise CommandError(f"{item!r}: expected MODEL=MILLISECONDS, e.g. embedder=50")
            if not Model.objects.filter(name=name).exists():
                raise CommandError(f"{name}: no such model in the registry")
            model_set_budget(model_name=name, latency_budget_ms=int(ms), actor="system:set_budgets")
            self.stdout.write(f"{name}: P99 budget {ms} ms")
