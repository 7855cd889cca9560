"""Thin Celery wrapper around the degradation automation."""

from celery import shared_task

from apps.degradation.automation import tick_all


@shared_task(name="degradation.tick_all", acks_late=True, expires=10, soft_time_limit=30)
def degradation_tick_all() -> None:
    """Level-triggered: every pool's tiers, every tick; a lost tick is replaced by the next."""
    tick_all()
