from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "apps.rollouts"
    label = "rollouts"
