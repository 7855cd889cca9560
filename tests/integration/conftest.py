"""Real services for integration tests: tritonserver nodes, Prometheus, Redis and a Celery worker,
each on free ports, each stopped at the end of the session whatever happens."""

import os
import shutil
import signal
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
from apps.fleet.triton import TritonClient
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
def clients(fleet: Fleet) -> list[TritonClient]:
    """Both nodes serving rag_pipeline v1, loaded through the repository API."""
    nodes = [
        TritonClient(fleet.state.node_urls(p)["http_url"], node=p.name) for p in fleet.state.nodes
    ]
    for client in nodes:
        fleet.devfleet.load_release(client, "rag_pipeline", 1)
    return nodes


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


class Celery:
    """Real `celery worker` (prefork, 3 processes) and `celery beat` processes on the test database
    and a private Redis, with short intervals so that periodic work shows up within seconds."""

    def __init__(self, root: Path, database_url: str, redis_url: str) -> None:
        self.root = root
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "CELERY_BROKER_URL": redis_url,
            "FLEET_POLL_INTERVAL_S": "1",
            "FLEET_RECONCILE_INTERVAL_S": "2",
            "FLEET_LEASE_S": "6",
        }
        self.worker: subprocess.Popen[bytes] | None = None
        self.beat: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _spawn(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        with (self.root / log).open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "controlplane", *args, "--loglevel=INFO"],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_worker(self) -> None:
        self.starts += 1
        self.worker = self._spawn(
            "worker",
            "--pool=prefork",
            "--concurrency=3",
            "--without-mingle",
            "--without-gossip",
            f"--hostname=test{self.starts}@%h",
            log="worker.log",
        )
        deadline = time.monotonic() + 60
        while not celery_app.control.ping(
            timeout=0.5, destination=[f"test{self.starts}@{socket.gethostname()}"]
        ):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"celery worker did not start; see {self.root / 'worker.log'}")

    def start_beat(self) -> None:
        self.beat = self._spawn(
            "beat",
            "--scheduler=celery.beat:PersistentScheduler",
            f"--schedule={self.root / 'beat-schedule'}",
            log="beat.log",
        )

    def kill_worker(self) -> None:
        """SIGKILL the whole worker (main process and its children), as an OOM killer would."""
        assert self.worker is not None
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(10)

    def stop(self) -> None:
        for proc in (self.worker, self.beat):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def celery(
    django_db_setup: None,
    django_db_blocker: object,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Celery]:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        database_url = _database_url()
    celery_app.conf.broker_url = redis_url
    processes = Celery(tmp_path_factory.mktemp("celery"), database_url, redis_url)
    try:
        processes.start_worker()
        processes.start_beat()
        yield processes
    finally:
        processes.stop()
