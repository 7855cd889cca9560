from argparse import ArgumentTypeError

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.registry.services import RegistryError, model_set_slo


class Command(BaseCommand):
    help = (
        "Set a model's service level objectives, the rollouts' burn-rate gate: the share of "
        "requests that must succeed and the share answered within its latency budget; an "
        "LLM's share of first tokens within some milliseconds (--ttft 0.99@800), which "
        "degradation holds it to as well."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--availability", type=float, help="e.g. 0.999; omitted: none")
        parser.add_argument("--latency", type=float, help="e.g. 0.99; omitted: none")
        parser.add_argument(
            "--ttft", type=_share_within, help="e.g. 0.99@800: 99%% within 800 ms; omitted: none"
        )

    def handle(
        self,
        *args: object,
        model: str,
        availability: float | None,
        latency: float | None,
        ttft: tuple[float, int] | None,
        **_: object,
    ) -> None:
        try:
            found = model_set_slo(
                model_name=model,
                availability=availability,
                latency=latency,
                ttft=ttft,
                actor="system:set_slo",
            )
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{model}: {found.slo or 'no objectives'}")


def _share_within(value: str) -> tuple[float, int]:
    """ "0.99@800": a share, and the milliseconds it must come within."""
    share, _, within = value.partition("@")
    try:
        return float(share), int(within)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not SHARE@MS, e.g. 0.99@800") from None
