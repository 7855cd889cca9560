"""Thin Celery wrappers around the rollout controller and the webhook."""

import json
import urllib.request

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from apps.rollouts.controller import rollout_advance
from apps.rollouts.models import Notification, Rollout


@shared_task(name="rollouts.advance_all", acks_late=True, expires=10)
def advance_all() -> None:
    """Level-triggered, like the reconciler: every active rollout, every tick."""
    for rollout_id in Rollout.objects.filter(state__in=Rollout.ACTIVE).values_list("id", flat=True):
        advance.delay(rollout_id)


# One tick does one transition under the rollout's row lock; a lost tick is replaced by the next.
@shared_task(name="rollouts.advance", acks_late=True, expires=10, soft_time_limit=30, time_limit=45)
def advance(rollout_id: int) -> None:
    rollout_advance(rollout_id=rollout_id)


class DeliveryFailed(Exception):
    pass


@shared_task(
    name="rollouts.deliver_notification",
    acks_late=True,
    autoretry_for=(DeliveryFailed,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=6,
)
def deliver_notification(notification_id: int) -> None:
    notification = Notification.objects.get(pk=notification_id)
    if notification.status == Notification.Status.SENT:
        return
    request = urllib.request.Request(  # noqa: S310 - the operator's configured webhook
        settings.ROLLOUT_WEBHOOK_URL,
        data=json.dumps(notification.payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    notification.attempts += 1
    try:
        with urllib.request.urlopen(request, timeout=5):  # noqa: S310
            pass
    except (OSError, ValueError) as exc:
        notification.last_error = str(exc)
        last = deliver_notification.request.retries >= (deliver_notification.max_retries or 0)
        notification.status = Notification.Status.FAILED if last else Notification.Status.PENDING
        notification.save()
        raise DeliveryFailed(str(exc)) from exc
    notification.status, notification.sent_at = Notification.Status.SENT, timezone.now()
    notification.last_error = ""
    notification.save()
