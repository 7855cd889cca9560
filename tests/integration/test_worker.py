import time

import pytest

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
