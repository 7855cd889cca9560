"""A load that hangs, as Triton's can until a restart (server#8766; here the simulator's `hang`
knob): it fails once the load timeout has passed, its node is quarantined (no traffic, no more
work), and the node works again only once it restarts or a person releases it, joining again.
A load whose connection closed before an answer is an unknown outcome, not a hang."""

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from apps.audit.models import AuditEvent
from apps.devtools.simulator import Simulator
from apps.fleet import failures
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.reconcile import node_reconcile
from apps.fleet.runner import node_run
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_clear, node_register
from apps.fleet.triton import TritonClient, TritonDropped
from tests.support.registry import import_demo

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

LOAD_TIMEOUT_S = 2.0


@pytest.fixture
def hanging(settings: object) -> Simulator:
    """A simulated node whose embedder loads hang, in pool gpu, which deploys embedder v1."""
    settings.FLEET_LOAD_TIMEOUT_S = LOAD_TIMEOUT_S  # type: ignore[attr-defined]
    import_demo()
    simulator = Simulator([0], hang={"embedder"})
    simulator.start()
    node_register(
        name="gpu-1",
        pool="gpu",
        http_url=simulator.urls[0],
        grpc_url="",
        metrics_url="",
        actor="system:test",
    )
    deployment_set(
        model_name="embedder", version=1, pool=NodePool.objects.get(), actor="system:test"
    )
    yield simulator
    simulator.stop()


def reconcile_and_run(node: Node) -> list[Operation]:
    planned = node_reconcile(node_id=node.pk)
    if planned:
        node_run(node_id=node.pk)
    return planned


def test_a_hung_load_fails_in_time_and_quarantines_its_node_until_it_restarts(
    hanging: Simulator,
) -> None:
    node = Node.objects.get()
    sent = time.monotonic()
    assert reconcile_and_run(node)
    took = time.monotonic() - sent
    load = Operation.objects.get()
    assert (load.status, load.failure) == (Operation.Status.FAILED, failures.STUCK)
    assert load.error.startswith("embedder v1 still LOADING 2 s after its load was sent")
    assert took < LOAD_TIMEOUT_S + 2  # the timeout, then one index read and one readiness call
    node.refresh_from_db()
    assert (node.stage, node.wanted_weight) == (Node.Stage.QUARANTINED, 0)
    assert node.stage_reason == load.error
    (event,) = AuditEvent.objects.filter(action="node.quarantine")
    assert (event.target, event.result) == ("node:gpu-1", "failed")

    assert node_reconcile(node_id=node.pk) == []  # left alone: nothing more is sent
    assert Operation.objects.count() == 1

    hanging.stop()  # Triton restarted: its index is empty, nothing LOADING
    restarted = Simulator(hanging.ports)
    restarted.start()
    try:
        assert reconcile_and_run(node)  # released, then its release is loaded again
        node.refresh_from_db()
        assert node.stage == Node.Stage.JOINING
        released = AuditEvent.objects.get(action="node.clear")
        assert released.actor == "system:reconciler"
        assert released.message == "embedder is no longer LOADING there: restarted"
        assert node_reconcile(node_id=node.pk) == []  # converged: it joins
        assert Node.objects.get().stage == Node.Stage.SERVING
    finally:
        restarted.stop()


def test_a_person_releases_a_quarantined_node_with_a_reason(hanging: Simulator) -> None:
    node = Node.objects.get()
    reconcile_and_run(node)
    node_clear(node_name="gpu-1", reason="restarted it by hand", actor="ops")
    node.refresh_from_db()
    assert (node.stage, node.stage_reason) == (Node.Stage.JOINING, "")
    event = AuditEvent.objects.get(action="node.clear")
    assert (event.actor, event.message) == ("ops", "restarted it by hand")


@pytest.fixture
def hangs_up() -> Iterator[str]:
    """A node that reads each request and closes the connection without an answer, as a
    tritonserver that crashes mid-load does."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_a_load_whose_connection_closed_is_an_unknown_outcome_not_a_hang(hangs_up: str) -> None:
    with pytest.raises(TritonDropped, match="HTTPConnectionClosed"):
        TritonClient(hangs_up, node="gpu-1").load("embedder")
    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(name="gpu-1", pool=pool, http_url=hangs_up)
    op = Operation.objects.create(
        node=node, kind="load", model_name="embedder", versions=[1], seq=0
    )
    node_run(node_id=node.pk)
    op.refresh_from_db()
    assert (op.status, op.failure) == (Operation.Status.UNKNOWN, failures.TIMEOUT)
    assert op.error.startswith("sent, and the connection closed before an answer: ")
    assert Node.objects.get().stage != Node.Stage.QUARANTINED
