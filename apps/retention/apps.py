from django.apps import AppConfig


class RetentionConfig(AppConfig):
    name = "apps.retention"
    label = "retention"
