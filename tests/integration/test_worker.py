import time

import pytest
from django.db import connection

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
    """Beat's heartbeat and polls keep the worker busy: connections it opened before `t0` still
    answer its tasks after it (Celery's own default would open a new one for every task)."""
    if connection.vendor != "postgresql":
        pytest.skip("a connection is a PostgreSQL backend, seen in pg_stat_activity")
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (t0,) = cursor.fetchone()
    poll_nodes.delay()
    time.sleep(8)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_start < %s"
            " AND state_change > %s + interval '4 seconds'",
            [t0, t0],
        )
        (kept,) = cursor.fetchone()
    assert kept >= 1
