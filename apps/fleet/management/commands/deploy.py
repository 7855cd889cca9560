from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.errors import FleetError
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set


class Command(BaseCommand):
    help = "Desire MODEL:VERSION on every node of POOL; the reconciler converges the nodes."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("release", metavar="MODEL:VERSION")

    def handle(self, *args: object, pool: str, release: str, **options: object) -> None:
        model, _, version = release.partition(":")
        target = NodePool.objects.filter(name=pool).first()
        if target is None:
            raise CommandError(f"no pool named {pool!r}")
        if not version.isdecimal():
            raise CommandError(f"{release!r}: expected MODEL:VERSION, e.g. rag_pipeline:1")
        try:
            deployment_set(
                model_name=model, version=int(version), pool=target, actor="system:deploy"
            )
        except FleetError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{model} v{version} desired on pool {pool}")
