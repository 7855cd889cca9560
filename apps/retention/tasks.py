"""Thin Celery wrappers: the service does the work."""

from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from apps.retention.services import retention_prune

# Stops between batches well before the soft limit; what is left goes on the next run, an hour
# later. A late run is no worse than an on-time one, so it never expires; no retries: the next
# run is the retry.
RUN_S = 240


@shared_task(name="retention.prune", acks_late=True, soft_time_limit=300, time_limit=360)
def prune() -> None:
    deadline = timezone.now() + timedelta(seconds=RUN_S)
    retention_prune(actor="system:retention", deadline=deadline)
