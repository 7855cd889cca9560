import os
from typing import Any

from celery import Celery
from celery.signals import before_task_publish, task_postrun, task_prerun, task_success
from django.db import close_old_connections
from django.utils import timezone

from apps.audit.context import adopt_request_id, carry_request_id
from apps.fleet.queues import ROLLOUT_TASKS, ROLLOUTS_QUEUE, TICK_HEARTBEAT

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_routes = {name: {"queue": ROLLOUTS_QUEUE} for name in ROLLOUT_TASKS}
# Celery's Django fixup closes every database connection before and after every task unless
# this is set: a new PostgreSQL backend for each task, which at fleet scale cost about as much
# CPU as the task itself (tests/bench/test_reconcile_scale.py). Connections are kept the way
# Django keeps them between requests instead (below).
app.conf["CELERY_DB_REUSE_MAX"] = 2**62
app.autodiscover_tasks()
before_task_publish.connect(carry_request_id)
task_prerun.connect(adopt_request_id)


@task_prerun.connect
@task_postrun.connect
def keep_connections(sender: Any = None, **_: object) -> None:
    """As around a request: a connection lives up to CONN_MAX_AGE, is health-checked before its
    first use in a task, and is closed once an error left it unusable. Not around a task run in
    the caller's process (`apply()`), whose connection and transaction are the caller's."""
    if not getattr(sender.request, "is_eager", False):
        close_old_connections()


@task_success.connect
def note_rollout_tick(sender: Any = None, **_: object) -> None:
    """When the rollout controller's tick last completed, for /metrics' tick age: rollouts (in
    apps.rollouts) stays unaware of how it is watched. One row, overwritten: a tick every
    ROLLOUT_TICK_S costs one indexed write."""
    if getattr(sender, "name", None) != "rollouts.advance_all":
        return
    from apps.fleet.models import Heartbeat  # the app registry is ready once tasks run

    Heartbeat.objects.update_or_create(name=TICK_HEARTBEAT, defaults={"at": timezone.now()})
