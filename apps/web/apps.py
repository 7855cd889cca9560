from django.apps import AppConfig


class WebConfig(AppConfig):
    """What pages and the database share below every app: htmx, the request guards, times,
    sessions, login throttling, and the written-out statements' helpers (bulk, prepared, clock)."""

    name = "apps.web"
    label = "web"
