from django.apps import AppConfig


class PrometheusConfig(AppConfig):
    """Prometheus' HTTP API (client.py) and the PromQL catalog, series by meaning (catalog.py)."""

    name = "apps.prometheus"
    label = "prometheus"
