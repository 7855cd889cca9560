from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "apps.fleet"
    label = "fleet"
