"""Webhook messages about rollouts (Slack-compatible JSON), written with the transition that
causes them and delivered afterwards by a worker: a slow or broken receiver never holds a
rollout up."""

from django.conf import settings
from django.db import transaction

from apps.rollouts.models import Notification, Rollout
from apps.rollouts.plans import parse_plan

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
    from apps.rollouts.tasks import deliver_notification  # tasks import the controller

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
    transaction.on_commit(lambda: deliver_notification.delay(notification.pk))
    return notification
