"""Rollout ticks and beat's heartbeat go to a queue of their own, so that a release's thousands
of node tasks on the default queue never delay a rollback decision."""

from django.conf import settings

from controlplane.celery import ROLLOUTS_QUEUE
from controlplane.celery import app as celery_app


def queue_of(task: str) -> str:
    return celery_app.amqp.router.route({}, task)["queue"].name


def test_the_rollout_controller_and_the_heartbeat_go_to_the_rollouts_queue() -> None:
    assert ROLLOUTS_QUEUE == "rollouts"
    for task in ("rollouts.advance_all", "rollouts.advance", "fleet.heartbeat"):
        assert queue_of(task) == "rollouts", task


def test_beats_schedule_sends_ticks_and_heartbeats_there_and_node_work_elsewhere() -> None:
    queues = {
        name: queue_of(entry["task"]) for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
    }
    assert queues["rollouts"] == queues["heartbeat"] == "rollouts"
    default = celery_app.conf.task_default_queue
    assert queues["poll-nodes"] == queues["reconcile"] == default != "rollouts"
    # A node's own work, and webhooks, stay on the default queue (or its pool's).
    for task in ("fleet.reconcile_node", "fleet.poll_node", "rollouts.deliver_notification"):
        assert queue_of(task) == default, task
