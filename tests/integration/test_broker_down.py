"""A real Redis, started for this test and then stopped: the web process stays ready, its pages
still render (none of them enqueues on a GET), and /metrics says the broker is down."""

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.contrib.auth.models import User
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from apps.accounts.models import ApiToken
from apps.accounts.services import token_create
from apps.fleet.models import Node, NodePool
from controlplane.celery import app as celery_app
from tests.support.services import redis_server

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# The overview, the lists people keep open, and a node's page: server-rendered from PostgreSQL.
PAGES = ["/", "/nodes/", "/nodes/?drift=1", "/nodes/gpu-1/", "/deployments/", "/rollouts/"]
# A page that would wait on the broker (a publish retries its connection) takes seconds.
FAST_S = 3.0


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A Redis of this test's own, and the Celery app pointed at it (its pools emptied, so a
    publish would really go there); the broker before is restored after."""
    before = celery_app.conf.broker_url
    with redis_server(tmp_path) as (server, url):
        celery_app.conf.broker_url = url
        celery_app._pool = None
        celery_app.amqp._producer_pool = None
        try:
            yield server, url
        finally:
            celery_app.conf.broker_url = before
            celery_app._pool = None
            celery_app.amqp._producer_pool = None


def broker_up(client: Client, headers: dict[str, str]) -> float:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    [family] = (
        f
        for f in text_string_to_metric_families(response.content.decode())
        if f.name == "controlplane_broker_up"
    )
    return family.samples[0].value


def test_the_ui_stays_up_while_the_broker_is_down(
    client: Client,
    viewer: User,
    settings: object,
    own_redis: tuple[subprocess.Popen[bytes], str],
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    server, url = own_redis
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1", health="ready")
    _, token = token_create(
        user=viewer, name="prometheus", actor="system:test", scope=ApiToken.Scope.READ
    )
    headers = {"Authorization": f"Bearer {token}"}
    client.force_login(viewer)
    assert redis.Redis.from_url(url).ping()
    assert client.get("/readyz").status_code == 200
    assert broker_up(client, headers) == 1

    server.terminate()
    server.wait(10)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()

    ready = client.get("/readyz")
    assert (ready.status_code, ready.content) == (200, b"database ok\n")
    for page in PAGES:
        started = time.monotonic()
        response = client.get(page)
        took = time.monotonic() - started
        assert response.status_code == 200, (page, response.status_code)
        assert took < FAST_S, (page, took)
    htmx = client.get("/nodes/", headers={"HX-Request": "true"})  # the list's live refresh
    assert htmx.status_code == 200
    started = time.monotonic()
    assert broker_up(client, headers) == 0
    assert time.monotonic() - started < FAST_S
