"""Retention: what the fleet and rollouts leave behind goes once it is old (departed nodes
among it), in small batches, so that no delete holds its locks for long. The audit trail is
kept (by month, apps/audit/partitions.py); what a running system still reads is kept whatever
its age: a node's latest operation of each model and its latest success (the reconciler and
the fleet pages read them), and every measurement of a rollout still under way."""

from collections.abc import Callable
from datetime import datetime, timedelta
from importlib import import_module

from axes.models import AccessAttempt, AccessFailureLog, AccessLog
from django.conf import settings
from django.contrib.sessions.backends.db import SessionStore as DbSessionStore
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from apps.approvals.models import Approval
from apps.audit.partitions import audit_partitions_ensure
from apps.audit.services import audit_record
from apps.fleet.models import Node, Operation
from apps.quality.models import CaseResult
from apps.rollouts.models import Measurement, Notification, Rollout

FINISHED = [
    Operation.Status.SUCCEEDED,
    Operation.Status.FAILED,
    Operation.Status.CANCELLED,
    Operation.Status.UNKNOWN,
]


def _operations(cutoff: datetime) -> list[models.QuerySet]:
    newer = Operation.objects.filter(
        node_id=OuterRef("node_id"), model_name=OuterRef("model_name"), pk__gt=OuterRef("pk")
    )
    return [
        Operation.objects.filter(status__in=FINISHED, finished_at__lt=cutoff)
        .filter(Exists(newer.filter(status__in=FINISHED)))
        .filter(
            ~Q(status=Operation.Status.SUCCEEDED)
            | Exists(newer.filter(status=Operation.Status.SUCCEEDED))
        )
    ]


def _measurements(cutoff: datetime) -> list[models.QuerySet]:
    return [Measurement.objects.filter(taken_at__lt=cutoff, rollout__state__in=Rollout.TERMINAL)]


def _notifications(cutoff: datetime) -> list[models.QuerySet]:
    waiting = Notification.Status.PENDING
    return [Notification.objects.filter(created_at__lt=cutoff).exclude(status=waiting)]


def _approvals(cutoff: datetime) -> list[models.QuerySet]:
    settled = ~Q(status=Approval.Status.PENDING) | Q(expires_at__lt=cutoff)
    return [Approval.objects.filter(settled, requested_at__lt=cutoff)]


def _answers(cutoff: datetime) -> list[models.QuerySet]:
    """What each version answered to each case of an evaluation run finished before the cutoff:
    the run keeps its score and counts (and its gate its verdict); the answers are the bulk."""
    return [CaseResult.objects.filter(run__finished_at__lt=cutoff)]


def _logins(cutoff: datetime) -> list[models.QuerySet]:
    return [
        model.objects.filter(attempt_time__lt=cutoff)
        for model in (AccessAttempt, AccessLog, AccessFailureLog)
    ]


def _departed(cutoff: datetime) -> list[models.QuerySet]:
    """Nodes departed since before the cutoff, with their operations and own deployments: a
    fleet whose pods come and go would keep every one of them otherwise."""
    return [Node.objects.filter(stage=Node.Stage.DEPARTED, stage_changed_at__lt=cutoff)]


KINDS: dict[str, Callable[[datetime], list[models.QuerySet]]] = {
    "departed": _departed,
    "operations": _operations,
    "measurements": _measurements,
    "notifications": _notifications,
    "approvals": _approvals,
    "answers": _answers,
    "logins": _logins,
}


def _expired_sessions(now: datetime) -> list[models.QuerySet]:
    """clearsessions, batched. Sessions kept in a cache or a cookie expire by themselves."""
    store = import_module(settings.SESSION_ENGINE).SessionStore
    if not issubclass(store, DbSessionStore):
        return []
    return [store.get_model_class().objects.filter(expire_date__lt=now)]


def _delete(queryset: models.QuerySet, deadline: datetime | None) -> int:
    """Delete what `queryset` selects, RETENTION_BATCH rows per transaction, until none is left
    or the deadline passed; how many rows went. Each batch is selected again by the same
    conditions, so a concurrent run, or a row that stopped qualifying, deletes nothing twice."""
    deleted = 0
    while deadline is None or timezone.now() < deadline:
        with transaction.atomic():
            ids = list(queryset.values_list("pk", flat=True)[: settings.RETENTION_BATCH])
            if ids:
                _, by_model = queryset.filter(pk__in=ids).delete()
                deleted += by_model.get(queryset.model._meta.label, 0)
        if len(ids) < settings.RETENTION_BATCH:
            break
    return deleted


def retention_prune(
    *, actor: str, now: datetime | None = None, deadline: datetime | None = None
) -> dict[str, int]:
    """Delete what outlived its retention (RETENTION_DAYS, or RETENTION_<KIND>_DAYS; 0 keeps a
    kind), and make the audit trail's coming partitions. One audit event with the counts. Stops
    at `deadline`, between batches: the next run carries on. Harmless to repeat."""
    now = now or timezone.now()
    counts = {"audit_partitions": audit_partitions_ensure()}
    for kind, selected in KINDS.items():
        days = settings.RETENTION_DAYS_BY_KIND[kind]
        querysets = selected(now - timedelta(days=days)) if days else []
        counts[kind] = sum(_delete(queryset, deadline) for queryset in querysets)
    counts["sessions"] = sum(_delete(qs, deadline) for qs in _expired_sessions(now))
    with transaction.atomic():
        audit_record(actor=actor, action="retention.prune", target="database", after=counts)
    return counts
