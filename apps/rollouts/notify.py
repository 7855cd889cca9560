"""Webhook messages (Slack-compatible JSON) about rollouts, the degradation automation's switches
and freezes, and approvals, written with the change that causes them and delivered afterwards by
a worker: a slow or broken receiver never holds a rollout or a switch up."""

import json
import urllib.request
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.rollouts.models import Notification, Rollout

DELIVER = "rollouts.deliver_notification"


def slack_text(text: object) -> str:
    """Text as Slack shows it literally: its control characters escaped (its rules for
    message text), so that a reason or a name holding `<!channel>` or `<https://x|click>`
    pings no one and links nowhere."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def notify_pool(*, pool: str, model: str, event: str, what: str) -> Notification | None:
    """A message about a pool's model that no rollout carries: the degradation automation's
    switches and its freeze, linking to the pool's tiers page."""
    if not settings.ROLLOUT_WEBHOOK_URL:
        return None
    link = f"{settings.SITE_URL}/pools/{pool}/tiers/"
    title = f"{slack_text(model)} on {slack_text(pool)}"
    about = {"pool": {"name": pool, "model": model, "event": event, "url": link}}
    return send(title, slack_text(what), link, event, about)


def notify_approval(*, approval_id: int, pool: str, event: str, what: str) -> Notification | None:
    """A message about a change waiting on a protected pool (asked, approved, rejected,
    withdrawn), linking to the pool's approvals."""
    if not settings.ROLLOUT_WEBHOOK_URL:
        return None
    link = f"{settings.SITE_URL}/rollouts/approvals/?{urlencode({'pool': pool})}"
    title = f"Approval #{approval_id} on {slack_text(pool)}"
    about = {"approval": {"id": approval_id, "pool": pool, "event": event, "url": link}}
    return send(title, slack_text(what), link, event, about)


def send(
    title: str,
    what: str,
    link: str,
    event: str,
    about: dict[str, Any],
    rollout: Rollout | None = None,
) -> Notification:
    """Written with the change that causes it, delivered after it commits."""
    payload = {
        "text": f"{title} {what} <{link}|details>",
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": f"*{title}* {what}"}}],
        **about,
    }
    notification = Notification.objects.create(rollout=rollout, event=event, payload=payload)
    # Addressed by name: the task (rollouts.tasks) wraps this module, not the other way round.
    # Robust: a broker away must not turn the committed transition into an error; the sweep
    # (notifications_lost) sends what it never took.
    transaction.on_commit(lambda: current_app.send_task(DELIVER, (notification.pk,)), robust=True)
    return notification


def notifications_lost(*, older_than_s: float = 60) -> list[int]:
    """Messages never tried, well after they were written: their task was lost (the broker was
    away at the commit, or lost it). A task takes a message within seconds otherwise."""
    since = timezone.now() - timedelta(seconds=older_than_s)
    lost = Notification.objects.filter(
        status=Notification.Status.PENDING, attempts=0, created_at__lt=since
    )
    return list(lost.order_by("id").values_list("id", flat=True)[:500])


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
