"""Thin Celery wrappers: ids in, the work in apps/performance/runs.py."""

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from apps.performance.analyzer import RUN_LIMIT_S
from apps.performance.runs import perf_execute, perf_failed
from apps.performance.search import search_execute, search_failed

# Claimed by a conditional update, so a redelivery after a lost worker is a no-op: the run then
# stays "running" and whoever waits on it gives up at its deadline (runs.perf_deadline). Each
# concurrency has its own timeout; the limits bound a whole run (analyzer.concurrency_range
# keeps the timeouts inside them).
MEASURE_SOFT_LIMIT_S, MEASURE_TIME_LIMIT_S = RUN_LIMIT_S, RUN_LIMIT_S + 30
# A search's every trial: a load and a measurement each, ten at most (search.py). The node is
# held aside meanwhile; a worker lost with it leaves it to the reconciler (apps/fleet/trials.py).
SEARCH_SOFT_LIMIT_S = 1_800


@shared_task(
    name="performance.measure",
    acks_late=True,
    soft_time_limit=MEASURE_SOFT_LIMIT_S,
    time_limit=MEASURE_TIME_LIMIT_S,
)
def measure(run_id: int) -> None:
    try:
        perf_execute(run_id=run_id)
    except SoftTimeLimitExceeded:
        perf_failed(run_id=run_id, error=f"stopped at its time limit of {MEASURE_SOFT_LIMIT_S} s")


@shared_task(
    name="performance.search",
    acks_late=True,
    soft_time_limit=SEARCH_SOFT_LIMIT_S,
    time_limit=SEARCH_SOFT_LIMIT_S + 60,
)
def search(search_id: int) -> None:
    try:
        search_execute(search_id=search_id)
    except SoftTimeLimitExceeded:
        search_failed(
            search_id=search_id, error=f"stopped at its time limit of {SEARCH_SOFT_LIMIT_S} s"
        )
