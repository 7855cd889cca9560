from django.apps import AppConfig


class PerformanceConfig(AppConfig):
    name = "apps.performance"
    label = "performance"
