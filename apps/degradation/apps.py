from django.apps import AppConfig


class DegradationConfig(AppConfig):
    """Degradation tiers: the versions a pool may step down to when its pipeline breaks its
    latency budget, and a person's pin on one of them. Above the rollouts and the fleet: one
    owner decides what a pool serves of a model at a time (fleet.PoolOwner)."""

    name = "apps.degradation"
    label = "degradation"
