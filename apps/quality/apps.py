from django.apps import AppConfig


class QualityConfig(AppConfig):
    name = "apps.quality"
    label = "quality"

    def ready(self) -> None:
        from apps.fleet.traffic.warmup import WARMUP_INPUTS
        from apps.quality.selectors import warmup_requests

        WARMUP_INPUTS.append(warmup_requests)
