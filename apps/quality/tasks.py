"""Thin Celery wrappers: ids in, the work in apps/quality/evaluations.py."""

from celery import shared_task

from apps.quality.evaluations import evaluation_execute, load_drive


# Claimed by a conditional update, so a redelivery after a lost worker is a no-op: the run then
# stays "running" and whoever waits on it (a rollout's gate) gives up at its deadline. Each case
# has its own timeout; the limits bound a whole set of them.
@shared_task(name="quality.run_evaluation", acks_late=True, soft_time_limit=540, time_limit=570)
def run_evaluation(run_id: int) -> None:
    evaluation_execute(run_id=run_id)


# Claimed like a run. A load lasts its `seconds` (an hour at most): a lost one is not sent
# again, and whoever needs requests asks for another.
@shared_task(name="quality.drive_load", acks_late=True, soft_time_limit=3630, time_limit=3660)
def drive_load(load_id: int) -> None:
    load_drive(load_id=load_id)
