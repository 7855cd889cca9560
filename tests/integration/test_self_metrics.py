"""A real Prometheus scrapes the control plane's own /metrics with a read-only API token from a
credentials file (the scrape config deploy/prometheus/prometheus.yml needs), and can query what it
read."""

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from django.contrib.auth.models import User
from django.test import Client
from kombu import Connection

from apps.accounts.models import ApiToken
from apps.accounts.roles import Role
from apps.accounts.services import token_create
from apps.api import metrics
from apps.fleet.models import Node, NodePool
from controlplane.celery import app as celery_app
from tests.support.metrics import make_fleet, matching, scrape, scrape_headers
from tests.support.services import redis_server
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(url: str, promql: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as response:  # noqa: S310
        return json.load(response)["data"]["result"]


def test_prometheus_scrapes_self_metrics_with_a_token_from_a_file(
    tmp_path: Path, live_server: Any
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("Prometheus is not installed: apt-get install -y prometheus")
    pool = NodePool.objects.create(name="it-self")
    for i in range(3):
        Node.objects.create(
            name=f"it-self-{i}", pool=pool, http_url="http://127.0.0.1:1", health="ready"
        )
    _, token = token_create(
        user=make_user(Role.VIEWER),
        name="prometheus",
        actor="system:test",
        scope=ApiToken.Scope.READ,
    )
    credentials = tmp_path / "controlplane.token"
    credentials.write_text(token + "\n")  # Prometheus trims the trailing newline
    target = urllib.parse.urlsplit(str(live_server)).netloc
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "controlplane",
                "metrics_path": "/metrics",
                "authorization": {"credentials_file": str(credentials)},
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is valid YAML
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        nodes: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not nodes:
            time.sleep(1)
            try:
                nodes = _query(url, 'controlplane_nodes{pool="it-self",health="ready"}')
            except OSError:
                continue  # not listening yet
        assert nodes, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert nodes[0]["value"][1] == "3"
        (up,) = _query(url, 'up{job="controlplane"}')
        assert up["value"][1] == "1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def headers(viewer: User) -> dict[str, str]:
    return scrape_headers(viewer)


def test_queue_depth_sums_every_priority_list_of_each_queue_in_use(
    client: Client, headers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"metrics-test-{uuid.uuid4().hex[:8]}"
    make_fleet("regional", nodes=1, queue=queue)
    make_fleet("local", nodes=1)
    # A broker of its own: the session's workers drain the shared one while the test counts.
    with redis_server(tmp_path) as (_, redis_url), Connection(redis_url) as conn:
        monkeypatch.setattr(celery_app.conf, "broker_url", redis_url)
        for name, priorities in [(queue, [0, 0, 5, 9, 9]), ("celery", [0, 9])]:
            waiting = conn.SimpleQueue(name)
            for priority in priorities:
                waiting.put({"n": priority}, priority=priority)
            waiting.close()
        # kombu spread them over several lists: the depth has to add them up.
        with redis.Redis.from_url(redis_url) as broker:
            assert len(broker.keys(f"{queue}*")) > 1
        samples = scrape(client, headers)
    depths = matching(samples, "controlplane_celery_queue_depth")
    assert depths == {("celery",): 2, ("rollouts",): 0, (queue,): 5}
    assert matching(samples, "controlplane_broker_up") == {(): 1}


def test_a_broker_that_accepts_and_never_answers_leaves_the_scrape_up_in_time(
    client: Client, headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        silent = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        monkeypatch.setattr(celery_app.conf, "broker_url", silent)
        make_fleet("gpu-a", nodes=1, queue="gpu")
        started = time.monotonic()
        samples = scrape(client, headers)
    assert time.monotonic() - started < 1 + metrics.BROKER_TIMEOUT_S
    assert matching(samples, "controlplane_broker_up") == {(): 0}
    assert matching(samples, "controlplane_celery_queue_depth") == {}
    assert matching(samples, "controlplane_nodes")[("ready", "gpu-a")] == 1
