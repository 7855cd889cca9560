from django.apps import AppConfig


class ScalingConfig(AppConfig):
    """How many nodes each pool needs (the signal an autoscaler follows), why, and what holds
    it: above the rollouts and degradation, whose releases it must not cut from under them."""

    name = "apps.scaling"
    label = "scaling"
