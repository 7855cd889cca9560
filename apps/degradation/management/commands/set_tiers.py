from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.degradation.services import TierError, parse_versions, tiers_set


class Command(BaseCommand):
    help = (
        "A pool's degradation tiers of a model: published versions with the same inputs and "
        "outputs, the primary first ('1,4': rag_pipeline, then without its reranker). Audited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("model")
        parser.add_argument("versions", help="comma-separated, the primary first: 1,4")

    def handle(self, *args: object, pool: str, model: str, versions: str, **_: object) -> None:
        try:
            numbers = parse_versions(versions)
            tiers_set(pool_name=pool, model_name=model, versions=numbers, actor="system:set_tiers")
        except TierError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{model} on {pool}: " + " > ".join(f"v{v}" for v in numbers))
