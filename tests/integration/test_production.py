"""The production stack from the commands in deploy/README.md: gunicorn serving pages and their
static files, a worker and beat; /readyz stays ready while the broker goes away and comes back,
and /metrics says it is down meanwhile."""

import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.fleet import wait_for
from tests.support.services import database_url, free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def documented_commands() -> list[str]:
    """The commands of the "Run it" section, in order."""
    guide = (ROOT / "deploy" / "README.md").read_text()
    section = guide.split("## Run it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "deploy/README.md has no commands under 'Run it'"
    return [line for line in block[1].splitlines() if line.strip()]


@contextmanager
def redis(port: int, home: Path) -> Iterator[subprocess.Popen[bytes]]:
    server = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""],
        stdout=subprocess.DEVNULL,
        cwd=home,
    )
    try:
        wait_for("redis answers", lambda: _answers(port), timeout=10)
        yield server
    finally:
        server.terminate()
        server.wait(10)


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _serves(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:  # refused, reset or timed out while the workers boot
        return False


def get(url: str) -> tuple[int, str]:
    """As through the TLS-terminating proxy production puts in front (X-Forwarded-Proto)."""
    request = urllib.request.Request(url, headers={"X-Forwarded-Proto": "https"})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - a local test URL
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_documented_production_stack_serves_and_reports_readiness(tmp_path: Path) -> None:
    web, broker = free_port(), free_port()
    database = database_url()
    env = {
        **os.environ,
        "DEBUG": "false",
        # Production refuses SQLite: a run of the tests on SQLite starts the stack without it.
        "PRODUCTION": str(database.startswith("postgres")).lower(),
        "SECRET_KEY": "production-test-secret-key-long-enough-for-django-checks",
        "DATABASE_URL": database,
        "CELERY_BROKER_URL": f"redis://127.0.0.1:{broker}/0",
        "ALLOWED_HOSTS": "127.0.0.1",
        "STATIC_ROOT": str(tmp_path / "static"),
        "BIND": f"127.0.0.1:{web}",
        "WEB_WORKERS": "2",
        "WORKER_CONCURRENCY": "1",
        "METRICS_ALLOW_ANONYMOUS": "true",
    }
    *once, gunicorn, worker, beat = documented_commands()
    assert "gunicorn" in gunicorn and " worker " in worker and " beat " in beat
    services: list[subprocess.Popen[bytes]] = []
    base = f"http://127.0.0.1:{web}"
    try:
        with redis(broker, tmp_path):
            for command in once:
                subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, check=True)
            for name, command in (("web", gunicorn), ("worker", worker), ("beat", beat)):
                with (tmp_path / f"{name}.log").open("wb") as log:
                    services.append(
                        subprocess.Popen(
                            ["bash", "-c", f"exec {command}"],
                            cwd=ROOT,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            # Its socket accepts before a worker has booted Django: wait for an answer.
            wait_for("gunicorn serves", lambda: _serves(f"{base}/healthz"), timeout=60)
            status, page = get(f"{base}/accounts/login/")
            assert status == 200 and "Sign in" in page
            stylesheet = re.search(r'href="(/static/[^"]+\.css)"', page)
            assert stylesheet, page
            assert get(base + stylesheet[1])[0] == 200  # WhiteNoise, from STATIC_ROOT
            assert get(f"{base}/healthz") == (200, "ok\n")
            wait_for("ready", lambda: get(f"{base}/readyz")[0] == 200, timeout=60)
            assert "controlplane_broker_up 1.0" in get(f"{base}/metrics")[1]
        # The broker went away: the web process stays ready (pages need only PostgreSQL), and
        # /metrics reports the broker down.
        assert get(f"{base}/readyz") == (200, "database ok\n")
        assert "controlplane_broker_up 0.0" in get(f"{base}/metrics")[1]
        with redis(broker, tmp_path):
            wait_for(
                "the broker back",
                lambda: "controlplane_broker_up 1.0" in get(f"{base}/metrics")[1],
                timeout=60,
            )
    finally:
        for service in services:
            os.killpg(service.pid, signal.SIGTERM)
        for service in services:
            try:
                service.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
