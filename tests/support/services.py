"""Real services for the integration tests and benchmarks, outside pytest's fixtures: a free port,
the test database's URL for other processes, a webhook receiver, and Celery worker and beat."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.db import connection

from apps.devtools.devfleet import PORT_PICKS
from apps.devtools.processes import held_sockets, tcp_ports
from controlplane.celery import app as celery_app
from tests.support import ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server(home: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of its own on a free port, keeping nothing on disk, once it listens there
    itself; and its URL. Stopped on the way out (if the test has not stopped it already). The
    port is free when picked, not when Redis binds it: another process (another xdist worker's
    Redis) may take it meanwhile, and this one then exits; it starts again on a new port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server")
    for _ in range(PORT_PICKS):
        port = free_port()
        server = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            cwd=home,
        )
        if _listening(server, port):
            break
    else:
        pytest.fail(f"redis-server exited on each of {PORT_PICKS} free ports")
    try:
        yield server, f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)


def _listening(server: subprocess.Popen[bytes], port: int) -> bool:
    """Whether `server` listens on `port` itself (False: it exited first); fails the test if it
    does neither within 10 s."""
    deadline = time.monotonic() + 10
    while server.poll() is None:
        try:
            if port in tcp_ports(held_sockets(server.pid), listening=True):
                return True
        except OSError:  # a descriptor closed while listed: look again
            pass
        if time.monotonic() > deadline:
            server.kill()
            server.wait(10)
            pytest.fail("redis-server did not start listening in 10 s")
        time.sleep(0.05)
    return False


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


def database_url() -> str:
    """The URL of the test database pytest-django created, for processes outside this one."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}"


# The nodes each pool needs: computed only where a test asks (`scaling`), so that every other
# test's audit trail stays its own.
SCALING_TICK_S = "3600"


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
            # A killed worker's load is taken over once it has timed out: the demo's take seconds.
            "FLEET_LOAD_TIMEOUT_S": "30",
            "ROLLOUT_TICK_S": "1",
            # Degradation tiers judged every second over 4 s and 10 s, 5 requests at least.
            "DEGRADATION_TICK_S": "1",
            "DEGRADATION_SHORT_S": "4",
            "DEGRADATION_LONG_S": "10",
            "DEGRADATION_MIN_REQUESTS": "5",
            "DEGRADATION_DWELL_UP_S": "65",
            "SCALING_TICK_S": SCALING_TICK_S,
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
            "--queues=celery,rollouts",  # the default queue and the rollout controller's
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

    @contextmanager
    def holding_rollouts(self) -> Iterator[None]:
        """The rollout controller's queue left unconsumed, once no tick of it runs or waits in
        the worker: the test ticks the controller itself, and reads what is between two ticks."""
        control = celery_app.control
        control.cancel_consumer("rollouts", destination=[self.hostname], reply=True, timeout=5)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                inspect = control.inspect(destination=[self.hostname], timeout=1)
                tasks = [
                    *(inspect.active() or {}).get(self.hostname, []),
                    *(inspect.reserved() or {}).get(self.hostname, []),
                ]
                if not any(task["name"].startswith("rollouts.") for task in tasks):
                    break
                time.sleep(0.2)
            else:
                pytest.fail("the worker kept running rollout ticks")
            yield
        finally:
            control.add_consumer("rollouts", destination=[self.hostname], reply=True, timeout=5)

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
        self.use_env(PROMETHEUS_URL=url)

    def use_env(self, **values: str | None) -> None:
        """Worker and beat restarted with these settings (None: unset) if any differs."""
        if all(self.env.get(name) == value for name, value in values.items()):
            return
        for name, value in values.items():
            if value is None:
                self.env.pop(name, None)
            else:
                self.env[name] = value
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
