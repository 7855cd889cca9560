"""Probes answer without a login and say only which dependency is not ready. Readiness is the
web process's and PostgreSQL's: neither the broker nor beat's heartbeat takes the UI down."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from apps.fleet.models import Heartbeat
from controlplane.celery import app as celery_app

pytestmark = pytest.mark.django_db


def test_healthz_answers_anyone(client: Client) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.content) == (200, b"ok\n")


def test_readyz_needs_no_heartbeat_from_a_worker(client: Client) -> None:
    assert not Heartbeat.objects.exists()
    response = client.get("/readyz")
    assert (response.status_code, response.content) == (200, b"database ok\n")
    Heartbeat.objects.create(name="worker", at=timezone.now() - timedelta(hours=1))
    assert client.get("/readyz").status_code == 200


def test_readyz_stays_ready_with_the_broker_away(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(celery_app.conf, "broker_url", "redis://127.0.0.1:1/0")
    response = client.get("/readyz")
    assert (response.status_code, response.content) == (200, b"database ok\n")


def test_readyz_says_the_database_is_unavailable_and_nothing_more(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("connection to server at 10.0.0.5 refused")

    monkeypatch.setattr(connection, "cursor", refused)
    response = client.get("/readyz")
    assert (response.status_code, response.content) == (503, b"database unavailable\n")
