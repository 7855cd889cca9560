"""Thin Celery wrappers around the rollout controller and the webhook."""

from celery import shared_task

from apps.rollouts.models import Rollout
from apps.rollouts.notify import (
    DELIVER,
    DeliveryFailed,
    notification_deliver,
    notifications_lost,
)
from apps.rollouts.tick import rollout_advance


@shared_task(name="rollouts.advance_all", acks_late=True, expires=10)
def advance_all() -> None:
    """Level-triggered, like the reconciler: every active rollout, every tick."""
    for rollout_id in Rollout.objects.filter(state__in=Rollout.ACTIVE).values_list("id", flat=True):
        advance.delay(rollout_id)


# One tick does one transition under the rollout's row lock; a lost tick is replaced by the next.
@shared_task(name="rollouts.advance", acks_late=True, expires=10, soft_time_limit=30, time_limit=45)
def advance(rollout_id: int) -> None:
    rollout_advance(rollout_id=rollout_id)


@shared_task(name="rollouts.deliver_lost", acks_late=True, expires=60)
def deliver_lost() -> None:
    """Messages whose delivery task never ran, sent again (at most a page a minute)."""
    for notification_id in notifications_lost():
        deliver_notification.delay(notification_id)


@shared_task(
    name=DELIVER,
    acks_late=True,
    autoretry_for=(DeliveryFailed,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=6,
)
def deliver_notification(notification_id: int) -> None:
    last = deliver_notification.request.retries >= (deliver_notification.max_retries or 0)
    notification_deliver(notification_id=notification_id, last_try=last)
