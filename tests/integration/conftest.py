"""Real services for integration tests: tritonserver nodes, Prometheus, Redis and a Celery worker,
each on free ports, each stopped at the end of the session whatever happens."""

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from apps.fleet.devfleet import Devfleet, FleetState
from controlplane.celery import app as celery_app

ROOT = Path(__file__).parents[2]
REPOSITORY = ROOT / "deploy" / "models"

pytestmark = pytest.mark.integration


@dataclass
class Fleet:
    devfleet: Devfleet
    state: FleetState


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    devfleet = Devfleet(home=tmp_path_factory.mktemp("devfleet"), repository=REPOSITORY)
    state = devfleet.up(nodes=2, pool="it", base_port=None, prometheus_port=None)
    try:
        yield Fleet(devfleet=devfleet, state=state)
    finally:
        devfleet.down()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server")
    port = _free_port()
    server = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        cwd=tmp_path_factory.mktemp("redis"),
    )
    try:
        for _ in range(100):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)


def _database_url() -> str:
    """The URL of the test database pytest-django created, for processes outside this one."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture(scope="session")
def celery_worker(
    django_db_setup: None,
    django_db_blocker: object,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[subprocess.Popen[bytes]]:
    """A real `celery worker` process on the test database and a private Redis."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        database_url = _database_url()
    env = {**os.environ, "DATABASE_URL": database_url, "CELERY_BROKER_URL": redis_url}
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "--pool=solo",
                "--without-mingle",
                "--without-gossip",
                "--loglevel=INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    celery_app.conf.broker_url = redis_url
    try:
        deadline = time.monotonic() + 60
        while not celery_app.control.ping(timeout=0.5):
            if worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"celery worker did not start; {log}:\n{log.read_text()[-2000:]}")
        yield worker
    finally:
        worker.terminate()
        worker.wait(20)
