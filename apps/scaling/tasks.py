"""Thin Celery wrapper around the signal's tick."""

from celery import shared_task

from apps.scaling.services import scaling_tick


@shared_task(name="scaling.tick", acks_late=True, expires=10, soft_time_limit=30, time_limit=45)
def scaling_tick_all() -> None:
    """Level-triggered: every pool's signal from what is read now; a lost tick is replaced by
    the next."""
    scaling_tick()
