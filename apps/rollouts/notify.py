"""Webhook messages about rollouts (Slack-compatible JSON), written with the transition that
causes them and delivered afterwards by a worker: a slow or broken receiver never holds a
rollout up."""

import json
import urllib.request

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.rollouts.models import Notification, Rollout
from apps.rollouts.plans import parse_plan

DELIVER = "rollouts.deliver_notification"
EVENTS = {
    "started": "started: v{baseline} → v{canary}, {share} first",
    "step": "moved to step {step}: v{canary} on {share}",
    "paused": "paused: {reason}",
    "promoting": "passed its analysis; promoting v{canary} to the whole pool",
    "succeeded": "succeeded: {pool} serves v{canary}",
    "aborting": "is rolling back to v{baseline}: {reason}",
    "rolled_back": "rolled back: {pool} serves v{baseline} again",
    "failed": "failed: {reason}",
}


def notify(rollout: Rollout, event: str) -> Notification | None:
    template = EVENTS.get(event)
    if template is None or not settings.ROLLOUT_WEBHOOK_URL:
        return None
    link = f"{settings.SITE_URL}/rollouts/{rollout.pk}/"
    step = parse_plan(rollout.plan)[rollout.step]
    what = template.format(
        step=rollout.step + 1,
        canary=rollout.canary_version,
        baseline=rollout.baseline_version,
        share=step.share,
        pool=rollout.pool.name,
        reason=rollout.reason,
    )
    title = f"Rollout #{rollout.pk} of {rollout.model.name} on {rollout.pool.name}"
    payload = {
        "text": f"{title} {what} <{link}|details>",
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": f"*{title}* {what}"}}],
        "rollout": {"id": rollout.pk, "state": rollout.state, "event": event, "url": link},
    }
    notification = Notification.objects.create(rollout=rollout, event=event, payload=payload)
    # Addressed by name: the task (rollouts.tasks) wraps this module, not the other way round.
    transaction.on_commit(lambda: current_app.send_task(DELIVER, (notification.pk,)))
    return notification


class DeliveryFailed(Exception):
    """The receiver did not take the message; the task tries again later."""


def notification_deliver(*, notification_id: int, last_try: bool) -> None:
    """POST the message to the webhook once; a failure is recorded (as final on the last try)
    and raised."""
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
        notification.status = (
            Notification.Status.FAILED if last_try else Notification.Status.PENDING
        )
        notification.save()
        raise DeliveryFailed(str(exc)) from exc
    notification.status, notification.sent_at = Notification.Status.SENT, timezone.now()
    notification.last_error = ""
    notification.save()
