from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.registry.models import Model
from apps.registry.services import RegistryError, model_set_fallback


class Command(BaseCommand):
    help = "Set a model's fallback: the degraded, faster release on-call switches a pool to."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("fallback", metavar="MODEL=VERSION")

    def handle(self, *args: object, fallback: str, **options: object) -> None:
        name, _, version = fallback.partition("=")
        if not version.isdecimal():
            raise CommandError(f"{fallback!r}: expected MODEL=VERSION, e.g. rag_pipeline=4")
        if not Model.objects.filter(name=name).exists():
            raise CommandError(f"{name}: no such model in the registry")
        try:
            model_set_fallback(model_name=name, version=int(version), actor="system:set_fallback")
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{name}: fallback v{version}")
