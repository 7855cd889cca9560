"""Probes answer without a login and say only which dependency is not ready."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.fleet.models import Heartbeat
from apps.fleet.tasks import heartbeat
from controlplane.celery import app as celery_app

pytestmark = pytest.mark.django_db


def test_healthz_answers_anyone(client: Client) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.content) == (200, b"ok\n")


def test_readyz_needs_a_recent_heartbeat_from_a_worker(client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.content.decode() == "database ok\nbroker ok\nworkers unavailable\n"
    heartbeat()  # as a worker runs it for beat
    assert client.get("/readyz").status_code == 200
    Heartbeat.objects.update(at=timezone.now() - timedelta(minutes=5))
    assert client.get("/readyz").status_code == 503


def test_readyz_says_the_broker_is_unavailable_and_nothing_more(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    heartbeat()
    monkeypatch.setattr(celery_app.conf, "broker_url", "redis://127.0.0.1:1/0")
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.content.decode() == "database ok\nbroker unavailable\nworkers ok\n"
