"""Rollout ticks and beat's heartbeat go to a queue of their own, so that a release's thousands
of node tasks on the default queue never delay a rollback decision."""

import pytest
from django.conf import settings

from apps.fleet import tasks
from apps.fleet.models import Node, NodePool
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


@pytest.mark.django_db
def test_a_change_outlives_the_queue_ahead_of_it_and_a_periodic_pass_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release queues a reconcile per node at once: at 5,000 nodes the last waits minutes, past
    the periodic pass's expiry, which would drop it unseen."""
    east = Node.objects.create(
        name="gpu-1", pool=NodePool.objects.create(name="gpu", queue="east"), http_url="http://x:1"
    )
    sent: list[dict] = []
    monkeypatch.setattr(
        tasks.reconcile_node, "apply_async", lambda args, **options: sent.append(options)
    )
    tasks.reconcile_change([east.pk])
    tasks.reconcile_all()
    assert sent == [{"queue": "east", "expires": tasks.CHANGE_EXPIRES_S}, {"queue": "east"}]
    assert tasks.reconcile_node.expires < tasks.CHANGE_EXPIRES_S
