from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.registry.services import RegistryError, model_set_slo


class Command(BaseCommand):
    help = (
        "Set a model's service level objectives, the rollouts' burn-rate gate: the share of "
        "requests that must succeed and the share answered within its latency budget."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--availability", type=float, help="e.g. 0.999; omitted: none")
        parser.add_argument("--latency", type=float, help="e.g. 0.99; omitted: none")

    def handle(
        self,
        *args: object,
        model: str,
        availability: float | None,
        latency: float | None,
        **_: object,
    ) -> None:
        try:
            model_set_slo(
                model_name=model,
                availability=availability,
                latency=latency,
                actor="system:set_slo",
            )
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{model}: availability {availability}, latency {latency}")
