"""Fixtures the unit tests share."""

import socket
import subprocess
from collections.abc import Callable, Iterator

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.urls import get_resolver

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.models import Node
from apps.fleet.services.nodes import node_register
from apps.registry.imports import repository_import
from controlplane.celery import app as celery_app
from tests.support import REPOSITORY


@pytest.fixture(autouse=True, scope="session")
def _every_view_imported() -> None:
    """Every module the URLs reach imported before any test stubs a function (say
    `apps.fleet.selectors.observed_many`): one first imported during that test would keep the
    stub it imported by name, for every test after it."""
    assert get_resolver().url_patterns


def _refused(what: str) -> Callable[..., None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a unit test {what}: it belongs in tests/integration")

    return refuse


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch: pytest.MonkeyPatch, settings: object) -> None:
    """A unit test runs in this process alone: it starts no process, serves no socket and
    reaches no service (a server, even a silent one, or a Redis, is an integration test's). It
    may find nothing answering at port 1, as a node or Prometheus that is down."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _refused("started a process"))
    monkeypatch.setattr(socket.socket, "bind", _refused("opened a server socket"))
    connect = socket.socket.connect

    def connect_to_nothing(sock: socket.socket, address: object) -> None:
        if not (isinstance(address, tuple) and address[1] == 1):
            _refused(f"connected to {address}")()
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect_to_nothing)
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    monkeypatch.setattr(celery_app.conf, "broker_url", "redis://127.0.0.1:1/0")


@pytest.fixture(autouse=True)
def _sessions_written_at_sign_in_only(settings: object) -> None:
    """A session is written again once a minute (apps/web/sessions.py): a page's query
    count would depend on the clock. tests/unit/test_security.py checks the writes."""
    settings.SESSION_TOUCH_S = 10**12  # type: ignore[attr-defined]


@pytest.fixture
def trail(db: None) -> list[AuditEvent]:
    return [
        audit_record(
            actor="ops",
            action="deployment.set",
            target="pool:gpu:rag",
            before={"version": 1},
            after={"version": 2},
        ),
        audit_record(
            actor="system:rollouts",
            action="rollout.aborting",
            target="rollout:7:rag",
            message="failure: p99 | above\nthreshold",
        ),
        audit_record(
            actor="viewer", action="rollout.start", target="/rollouts/new/", result="denied"
        ),
    ]


@pytest.fixture
def node(db: None) -> Node:
    """Node n1 of pool p (nothing answers at its address), the demo repository imported."""
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    urls = {"grpc_url": "127.0.0.1:8101", "metrics_url": "http://127.0.0.1:8102/metrics"}
    return node_register(
        name="n1", pool="p", http_url="http://127.0.0.1:1", actor="system:test", **urls
    )


@pytest.fixture
def migrator() -> Iterator[MigrationExecutor]:
    """For a test of a data migration, which takes the schema back to before it: every app's
    latest migration again afterwards, for the tests after it on the same database."""
    yield MigrationExecutor(connection)
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
