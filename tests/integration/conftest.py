"""Real services for integration tests: tritonserver nodes, Prometheus, Redis and a Celery worker,
each on free ports, each stopped at the end of the session whatever happens."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.db import connection

from apps.fleet.devfleet import Devfleet, FleetState
from apps.fleet.models import Node, NodePool
from apps.fleet.services import node_register
from apps.fleet.traffic import send_traffic
from apps.fleet.triton import TritonClient
from apps.registry.imports import repository_import
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


class Webhook(ThreadingHTTPServer):
    """A Slack-like receiver: keeps every JSON body; answers 500 while `failures` is positive."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.failures = 0
        super().__init__(("127.0.0.1", 0), _WebhookHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/rollouts"


class _WebhookHandler(BaseHTTPRequestHandler):
    server: Webhook

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.server.failures > 0:
            self.server.failures -= 1
            self.send_response(500)
        else:
            self.server.received.append(json.loads(body))
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def webhook() -> Iterator[Webhook]:
    server = Webhook()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()


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

    def __init__(self, root: Path, database_url: str, redis_url: str, webhook_url: str) -> None:
        self.root = root
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "CELERY_BROKER_URL": redis_url,
            "FLEET_POLL_INTERVAL_S": "1",
            "FLEET_RECONCILE_INTERVAL_S": "2",
            "FLEET_LEASE_S": "6",
            "ROLLOUT_TICK_S": "1",
            "ROLLOUT_WEBHOOK_URL": webhook_url,
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
        while not celery_app.control.ping(timeout=0.5, destination=[self.hostname]):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"celery worker did not start; see {self.root / 'worker.log'}")

    def start_worker_for(self, queue: str) -> subprocess.Popen[bytes]:
        """A second worker that takes tasks from `queue` only, as one in a pool's own region
        would; the caller stops it. Its log is `worker-<queue>.log`."""
        worker = self._spawn(
            "worker",
            "--pool=prefork",
            "--concurrency=2",
            "--without-mingle",
            "--without-gossip",
            f"--queues={queue}",
            f"--hostname={queue}@%h",
            log=f"worker-{queue}.log",
        )
        deadline = time.monotonic() + 60
        hostname = f"{queue}@{socket.gethostname()}"
        while not celery_app.control.ping(timeout=0.5, destination=[hostname]):
            if worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"celery worker for {queue} did not start; see {self.root}")
        return worker

    @property
    def hostname(self) -> str:
        return f"test{self.starts}@{socket.gethostname()}"

    def pause(self) -> None:
        """Stop taking tasks and wait for the running ones, so that the test database can be
        emptied (TRUNCATE) without racing the worker: waiting on each other's locks deadlocks."""
        control = celery_app.control
        control.cancel_consumer("celery", destination=[self.hostname], reply=True, timeout=5)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            active = control.inspect(destination=[self.hostname], timeout=1).active() or {}
            if not active.get(self.hostname):
                return
            time.sleep(0.2)

    def resume(self) -> None:
        celery_app.control.add_consumer(
            "celery", destination=[self.hostname], reply=True, timeout=5
        )

    def start_beat(self) -> None:
        self.beat = self._spawn(
            "beat",
            "--scheduler=celery.beat:PersistentScheduler",
            f"--schedule={self.root / 'beat-schedule'}",
            log="beat.log",
        )

    def use_prometheus(self, url: str) -> None:
        """Point the worker (rollout analysis) at `url`: restarts worker and beat if it changes."""
        if self.env.get("PROMETHEUS_URL") == url:
            return
        self.env["PROMETHEUS_URL"] = url
        self.stop()
        self.start_worker()
        self.start_beat()

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
def celery_processes(
    django_db_setup: None,
    django_db_blocker: object,
    redis_url: str,
    webhook: "Webhook",
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Celery]:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        database_url = _database_url()
    celery_app.conf.broker_url = redis_url
    processes = Celery(tmp_path_factory.mktemp("celery"), database_url, redis_url, webhook.url)
    try:
        processes.start_worker()
        processes.start_beat()
        yield processes
    finally:
        processes.stop()


@pytest.fixture
def celery(celery_processes: Celery) -> Iterator[Celery]:
    """The worker and beat for one test: the worker takes tasks during the test and is paused
    when it ends, before the database is emptied."""
    celery_processes.resume()
    yield celery_processes
    celery_processes.pause()


# Three nodes of the (copied) demo repository, for a test module -----------------------------

STEPS_V1 = {
    ("embedder", 1),
    ("retriever", 1),
    ("reranker", 1),
    ("generator", 1),
    ("rag_pipeline", 1),
}
# Short, so that a whole rollout fits in a test: judged every 2 s over the last 10 s, once 5 s of
# warm-up and a whole window have passed since the canary was READY. Everything (3 nodes, traffic, Prometheus, worker) shares 2 cores
# here, so latencies are noisy: a release passes unless 100 ms and 2x worse than its baseline;
# the slow v3 adds 250 ms to every request.
ANALYSIS = {
    "interval_s": 2,
    "window_s": 10,
    "warmup_s": 5,
    "min_requests": 5,
    "p99_tolerance": 1.0,
    "p99_margin_ms": 100,
}

STEPS_V2 = {
    ("embedder", 2),
    ("retriever", 2),
    ("reranker", 2),
    ("generator", 2),
    ("rag_pipeline", 2),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the demo repository that tests may add versions to."""
    root = tmp_path_factory.mktemp("repo") / "deploy"
    shutil.copytree(
        ROOT / "deploy" / "models", root / "models", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(
        ROOT / "deploy" / "ragkit", root / "ragkit", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root / "models"


@pytest.fixture(scope="module")
def trio(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Devfleet, FleetState]]:
    devfleet = Devfleet(home=tmp_path_factory.mktemp("trio"), repository=repository)
    state = devfleet.up(nodes=3, pool="trio", base_port=None, prometheus_port=None)
    try:
        yield devfleet, state
    finally:
        devfleet.down()


@pytest.fixture
def pool(trio: tuple[Devfleet, FleetState], repository: Path, celery: Celery) -> Iterator[NodePool]:
    """The trio registered and the demo repository imported."""
    _, state = trio
    for proc in state.nodes:
        node_register(name=proc.name, pool="trio", actor="system:test", **state.node_urls(proc))
    results = repository_import(path=repository, actor="system:test")
    assert all(r.ok for r in results)
    return NodePool.objects.get(name="trio")


def ready_on(node: Node) -> set[tuple[str, int]]:
    client = TritonClient(node.http_url, node=node.name)
    return {
        (e.model, e.version) for e in client.repository_index() if e.state == "READY" and e.version
    }


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.5)


def converged(pool: NodePool, expected: set[tuple[str, int]]) -> Callable[[], bool]:
    def check() -> bool:
        return all(ready_on(node) == expected for node in pool.nodes.all())

    return check


@contextmanager
def traffic_to(state: FleetState) -> Iterator[None]:
    """Unversioned rag_pipeline requests to every node, 8 per second, while it lasts; it starts
    once the pipeline is served."""
    clients = [TritonClient(state.node_urls(p)["http_url"], node=p.name) for p in state.nodes]
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            send_traffic(clients, model="rag_pipeline", rps=8, seconds=2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture
def traffic(trio: tuple[Devfleet, FleetState]) -> Iterator[None]:
    with traffic_to(trio[1]):
        yield
