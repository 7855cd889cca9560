from datetime import datetime, timedelta

from django.utils import timezone

from apps.rollouts.models import Rollout

MARGIN = timedelta(minutes=5)


def rollout_window(rollout: Rollout) -> tuple[datetime, datetime]:
    """A rollout's span with five minutes either side: its incident review window."""
    now = timezone.now()
    return rollout.created_at - MARGIN, min(now, (rollout.finished_at or now) + MARGIN)
