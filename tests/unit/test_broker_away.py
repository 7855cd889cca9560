"""A broker away never turns a committed change into an error, and what it never delivered is
found again: the periodic reconcile carries out the change, a sweep sends the notification."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from kombu.exceptions import OperationalError

from apps.accounts.roles import Role
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services import deployments
from apps.registry.models import ModelVersion
from apps.rollouts import tasks
from apps.rollouts.models import Notification, Rollout
from tests.support.registry import import_demo
from tests.support.users import bearer, make_user


def broker_away(*_: object, **__: object) -> None:
    raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


@pytest.mark.django_db(transaction=True)  # the enqueue runs once the change has committed
def test_a_deployment_commits_and_answers_though_the_broker_is_away(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    monkeypatch.setattr(deployments, "reconcile_change", broker_away)
    body = {"model": "embedder", "version": 1, "pool": "gpu"}
    made = client.post(
        "/api/deployments", body, "application/json", headers=bearer(make_user(Role.ADMIN))
    )
    assert made.status_code == 201, made.content
    assert Deployment.objects.get(pool=pool).version == 1


@pytest.mark.django_db
def test_a_notification_whose_task_never_ran_is_sent_by_the_sweep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import_demo()
    rollout = Rollout.objects.create(
        model=ModelVersion.objects.get(model__name="embedder", version=1).model,
        pool=NodePool.objects.create(name="gpu"),
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
        started_by="ann",
    )
    made = {
        name: Notification.objects.create(rollout=rollout, event="started", payload={}, **fields)
        for name, fields in {
            "lost": {},
            "just written": {},
            "retrying": {"attempts": 1},
            "sent": {"status": Notification.Status.SENT},
        }.items()
    }
    long_ago = timezone.now() - timedelta(minutes=5)
    Notification.objects.exclude(pk=made["just written"].pk).update(created_at=long_ago)
    sent: list[int] = []
    monkeypatch.setattr(tasks.deliver_notification, "delay", sent.append)
    tasks.deliver_lost()
    assert sent == [made["lost"].pk]
