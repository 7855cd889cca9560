import pytest

from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.fleet.polling import node_poll
from apps.fleet.services.nodes import node_register


@pytest.mark.django_db
def test_a_node_becomes_unreachable_after_a_few_failed_polls_and_says_why(settings: object) -> None:
    settings.FLEET_UNREACHABLE_AFTER = 3
    node = Node.objects.create(
        name="n1",
        pool=NodePool.objects.create(name="p"),
        health=Node.Health.READY,
        http_url="http://127.0.0.1:1",  # nothing answers there
    )
    for _ in range(2):
        node = node_poll(node_id=node.id)
    assert node.health == Node.Health.READY and node.failed_polls == 2
    assert "n1: " in node.last_error
    for _ in range(3):
        node = node_poll(node_id=node.id)
    assert node.health == Node.Health.UNREACHABLE
    # A node that stays down is recorded once, not once per poll.
    assert AuditEvent.objects.filter(action="node.down", target="node:n1").count() == 1


@pytest.mark.django_db
def test_registering_twice_with_the_same_addresses_is_one_audit_event() -> None:
    urls = {
        "http_url": "http://127.0.0.1:8100",
        "grpc_url": "127.0.0.1:8101",
        "metrics_url": "http://127.0.0.1:8102/metrics",
    }
    node_register(name="demo-1", pool="demo", actor="system:test", **urls)
    node_register(name="demo-1", pool="demo", actor="system:test", **urls)
    node_register(
        name="demo-1",
        pool="demo",
        actor="system:test",
        **{**urls, "http_url": "http://127.0.0.1:8200"},
    )
    events = AuditEvent.objects.filter(action="node.register").order_by("id")
    assert [e.after["http_url"] for e in events] == [
        "http://127.0.0.1:8100",
        "http://127.0.0.1:8200",
    ]
    assert events[1].before["http_url"] == "http://127.0.0.1:8100"
