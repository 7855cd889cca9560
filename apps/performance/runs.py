"""A measurement run by a worker: perf_analyzer against the node, each concurrency's figures
stored for the gate that waits on it and the pages that draw it."""

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from apps.performance.analyzer import PerfError, perf_measure
from apps.performance.models import PerfPoint, PerfRun


def perf_execute(*, run_id: int) -> None:
    """Measure and store. Claimed by a conditional update, so a run delivered twice runs once."""
    claimed = PerfRun.objects.filter(pk=run_id, status=PerfRun.Status.QUEUED).update(
        status=PerfRun.Status.RUNNING, started_at=timezone.now()
    )
    if claimed != 1:
        return
    run = PerfRun.objects.select_related("model", "node").get(pk=run_id)
    try:
        if run.node is None or not run.node.grpc_url:
            raise PerfError(f"{run.node_name}: no gRPC endpoint to measure at")
        points = perf_measure(
            grpc_url=run.node.grpc_url,
            model=run.model.name,
            version=run.version,
            concurrencies=tuple(run.concurrencies),  # type: ignore[arg-type]
            requests=run.requests,
            node=run.node_name,
            inputs=run.model.sample_inputs,
            batched=_batched(run),
            streaming=run.streaming,
            timeout_s=run.timeout_s,
        )
    except PerfError as exc:
        return perf_failed(run_id=run_id, error=str(exc))
    with transaction.atomic():
        PerfPoint.objects.bulk_create(PerfPoint(run=run, **vars(point)) for point in points)
        PerfRun.objects.filter(pk=run_id).update(
            status=PerfRun.Status.DONE, finished_at=timezone.now()
        )


def perf_failed(*, run_id: int, error: str) -> None:
    """A run that could not measure, or was stopped: failed, saying why."""
    PerfRun.objects.filter(pk=run_id, status__in=PerfRun.OPEN).update(
        status=PerfRun.Status.FAILED, error=error, finished_at=timezone.now()
    )


def _batched(run: PerfRun) -> bool:
    config = run.model.versions.filter(version=run.version).values_list("config", flat=True)
    return bool((config.first() or {}).get("max_batch_size", 0))


def perf_deadline(run: PerfRun) -> datetime:
    """When a run that has not finished is given up (its worker lost): each concurrency at its
    timeout, and a minute to reach a worker."""
    return run.created_at + timedelta(seconds=60 + len(run.concurrency_range) * run.timeout_s)
