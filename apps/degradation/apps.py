from django.apps import AppConfig


class DegradationConfig(AppConfig):
    """Degradation tiers: the versions a pool may step down to when its pipeline breaks its
    latency budget, and a person's pin on one of them. Above the rollouts and the fleet: one
    owner decides what a pool serves of a model at a time."""

    name = "apps.degradation"
    label = "degradation"

    def ready(self) -> None:
        from apps.degradation.services import pin_owning
        from apps.fleet.services.deployments import POOL_OWNERS

        POOL_OWNERS.append(pin_owning)
