from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "apps.rollouts"
    label = "rollouts"

    def ready(self) -> None:
        from apps.fleet.services.deployments import POOL_OWNERS
        from apps.rollouts.services import rollout_owning

        POOL_OWNERS.append(rollout_owning)
