import time
from contextlib import suppress
from pathlib import Path

import pytest
from django.db import connection

from apps.devtools.processes import held_sockets, proc_stat, tcp_ports
from apps.fleet.models import Node
from apps.fleet.services.nodes import node_register
from apps.fleet.tasks import poll_nodes
from tests.support.fleet import Fleet
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the worker"
        time.sleep(0.2)


def test_worker_polls_every_node_and_records_what_triton_reports(
    fleet: Fleet, celery: Celery
) -> None:
    for proc in fleet.state.nodes:
        node_register(name=proc.name, pool="it", actor="system:test", **fleet.state.node_urls(proc))
    node_register(
        name="gone",
        pool="it",
        actor="system:test",
        http_url="http://127.0.0.1:9",
        grpc_url="",
        metrics_url="",
    )
    poll_nodes.delay()

    def polled() -> bool:
        live = Node.objects.exclude(name="gone")
        return (
            all(n.health == Node.Health.READY for n in live)
            and Node.objects.get(name="gone").health == Node.Health.UNREACHABLE
        )

    wait_for(polled)
    for node in Node.objects.exclude(name="gone"):
        assert node.triton_version == "2.51.0"
        assert "model_repository" in node.extensions
        assert node.last_seen is not None
    gone = Node.objects.get(name="gone")
    # Beat kept polling it: unreachable after a few failures in a row, saying why.
    assert "gone:" in gone.last_error and gone.failed_polls >= 3


def test_a_worker_keeps_its_database_connection_from_task_to_task(celery: Celery) -> None:
    """Beat's ticks keep the worker busy, a task every second or so: one of the worker's own
    database connections (its processes' sockets, not beat's) serves queries seconds after it
    was opened, so across tasks. Celery's own default would close it after every task."""
    if connection.vendor != "postgresql":
        pytest.skip("a connection is a PostgreSQL backend, seen in pg_stat_activity")
    worker = celery.worker
    assert worker is not None
    poll_nodes.delay()

    def reused() -> bool:
        ports = local_ports(process_tree(worker.pid))
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND client_port = ANY(%s) AND state_change > backend_start + interval '4 s'",
                [sorted(ports)],
            )
            (kept,) = cursor.fetchone()
        return kept > 0

    wait_for(reused)


def process_tree(pid: int) -> set[int]:
    """`pid` and its children (a prefork worker's processes)."""
    children = set()
    for entry in Path("/proc").glob("[0-9]*"):
        stat = proc_stat(int(entry.name))  # None: ended meanwhile
        if stat is not None and int(stat[1]) == pid:
            children.add(int(entry.name))
    return {pid} | children


def local_ports(pids: set[int]) -> set[int]:
    """The local ports of the TCP connections these processes hold."""
    sockets: set[str] = set()
    for pid in pids:
        with suppress(OSError):  # ended meanwhile
            sockets |= held_sockets(pid)
    return tcp_ports(sockets, listening=False)
