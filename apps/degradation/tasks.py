"""Thin Celery wrappers around the degradation automation."""

from celery import shared_task

from apps.degradation.automation import tiers_tick
from apps.degradation.models import Tiers


@shared_task(name="degradation.tick_all", acks_late=True, expires=10)
def degradation_tick_all() -> None:
    """Level-triggered: every pool's tiers, every tick, each in a task of its own (one pool's
    slow Prometheus answer holds no other back); a lost tick is replaced by the next."""
    for tiers_id in Tiers.objects.values_list("id", flat=True):
        degradation_tick.delay(tiers_id)


@shared_task(name="degradation.tick", acks_late=True, expires=10, soft_time_limit=30, time_limit=45)
def degradation_tick(tiers_id: int) -> None:
    tiers_tick(tiers_id=tiers_id)
