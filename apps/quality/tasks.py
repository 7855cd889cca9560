"""Thin Celery wrappers: ids in, the work in apps/quality/evaluations.py."""

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from apps.fleet.tasks import send_to
from apps.quality.evaluations import (
    evaluation_execute,
    evaluation_timed_out,
    load_drive,
    runs_unsent,
)

# Claimed by a conditional update, so a redelivery after a lost worker is a no-op: the run then
# stays "running" and whoever waits on it (a rollout's gate) gives up at its deadline, at most
# the hard limit and a minute (apps.rollouts.gate.gate_deadline). Each case has its own
# timeout; the limits bound a whole set of them, and the soft one fails the run, saying so.
RUN_SOFT_LIMIT_S, RUN_TIME_LIMIT_S = 540, 570


@shared_task(
    name="quality.run_evaluation",
    acks_late=True,
    soft_time_limit=RUN_SOFT_LIMIT_S,
    time_limit=RUN_TIME_LIMIT_S,
)
def run_evaluation(run_id: int) -> None:
    try:
        evaluation_execute(run_id=run_id)
    except SoftTimeLimitExceeded:
        evaluation_timed_out(run_id=run_id, limit_s=RUN_SOFT_LIMIT_S)


# Claimed like a run. A load lasts its `seconds` (an hour at most): a lost one is not sent
# again, and whoever needs requests asks for another.
@shared_task(name="quality.drive_load", acks_late=True, soft_time_limit=3630, time_limit=3660)
def drive_load(load_id: int) -> None:
    load_drive(load_id=load_id)


# A run is sent once its transaction commits; with the broker away then, it stays queued. Sent
# again here, each minute for its first minutes (a redelivered run is claimed once): past them,
# whoever waited on it has given up (apps.rollouts.gate.gate_deadline).
@shared_task(name="quality.resend_queued", acks_late=True, expires=60)
def resend_queued() -> None:
    for run_id, queue in runs_unsent():
        send_to(queue, run_evaluation, run_id)
