from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.degradation.services import TierError, tier_pin, tier_unpin


class Command(BaseCommand):
    help = (
        "Pin a pool's model to one of its tiers (0: the primary) for some hours, with a reason: "
        "the pool serves it now and nothing else moves it meanwhile. --unpin lifts the pin. "
        "Audited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("pool")
        parser.add_argument("model")
        parser.add_argument("tier", type=int, nargs="?")
        parser.add_argument("--reason", default="")
        parser.add_argument("--hours", type=float, default=4.0)
        parser.add_argument("--unpin", action="store_true")

    def handle(self, *args: object, pool: str, model: str, **options: object) -> None:
        actor = "system:pin_tier"
        try:
            if options["unpin"]:
                tier_unpin(pool_name=pool, model_name=model, actor=actor)
                self.stdout.write(f"{model} on {pool}: unpinned")
                return
            if options["tier"] is None:
                raise CommandError("name the tier to pin (0: the primary), or --unpin")
            tiers = tier_pin(
                pool_name=pool,
                model_name=model,
                tier=int(str(options["tier"])),
                reason=str(options["reason"]),
                hours=float(str(options["hours"])),
                actor=actor,
            )
        except TierError as exc:
            raise CommandError(str(exc)) from None
        assert tiers.pinned is not None and tiers.pinned_until is not None
        self.stdout.write(
            f"{model} on {pool}: pinned to tier {tiers.pinned} (v{tiers.versions[tiers.pinned]}) "
            f"until {tiers.pinned_until:%Y-%m-%d %H:%M} UTC"
        )
