"""Node up/down transitions and reconcile drift as system events, without flooding the trail.
Triton is stubbed at the client boundary and the clock is ours."""

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import audit_append
from apps.fleet.models import Node, NodePool
from apps.fleet.polling import node_poll
from apps.fleet.reconcile import _drift
from apps.fleet.triton import ServerMetadata, TritonClient, TritonUnreachable

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(timezone, "now", lambda: clock.now)  # events are stamped by it too
    return clock


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, settings: object) -> Node:
    settings.FLEET_UNREACHABLE_AFTER = 1  # type: ignore[attr-defined]
    settings.FLEET_FLAP_LIMIT, settings.FLEET_FLAP_WINDOW_S = 4, 600  # type: ignore[attr-defined]
    settings.FLEET_FLAP_SETTLE_S = 60  # type: ignore[attr-defined]
    up = {"n1": True}

    def health(self: TritonClient) -> str:
        if not up[self.node]:
            raise TritonUnreachable(self.node, "connection refused")
        return "ready"

    monkeypatch.setattr(TritonClient, "health", health)
    monkeypatch.setattr(TritonClient, "server_metadata", lambda self: ServerMetadata("2.51", []))
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    node = Node.objects.create(
        name="n1", pool=NodePool.objects.create(name="p"), http_url="http://10.0.0.1:8000"
    )
    node.up = up  # type: ignore[attr-defined]
    return node


def trail() -> list[tuple[str, str]]:
    events = AuditEvent.objects.filter(target="node:n1").order_by("created_at", "id")
    return [(e.action, e.result) for e in events]


def test_a_node_that_goes_down_and_comes_back_is_two_events(node: Node, clock: Clock) -> None:
    for up in (True, False, False, True, True):
        node.up["n1"] = up  # type: ignore[attr-defined]
        node_poll(node_id=node.pk)
        clock.advance(5)
    assert trail() == [("node.down", "failed"), ("node.up", "ok")]


def test_a_flapping_node_is_folded_until_it_settles(node: Node, clock: Clock) -> None:
    for flip in range(10):  # down, up, down... every 5 s
        clock.advance(5)
        node.up["n1"] = flip % 2 == 1  # type: ignore[attr-defined]
        node_poll(node_id=node.pk)
    clock.advance(10)
    node_poll(node_id=node.pk)  # up, but not for long enough yet
    recorded = [("node.down", "failed"), ("node.up", "ok")] * 2 + [("node.flapping", "failed")]
    assert trail() == recorded
    assert Node.objects.get(pk=node.pk).unrecorded_transitions == 6
    clock.advance(51)
    node_poll(node_id=node.pk)
    assert trail() == [*recorded, ("node.up", "ok")]
    settled = AuditEvent.objects.filter(target="node:n1").first()
    assert settled and settled.after == {"health": "ready", "unrecorded_changes": 6}
    assert "settled after 6 unrecorded changes" in settled.message
    assert Node.objects.get(pk=node.pk).unrecorded_transitions == 0


def test_the_same_drift_repaired_again_soon_is_recorded_once(node: Node, clock: Clock) -> None:
    def drifted(operations: list[str]) -> None:
        audit_append([event] if (event := _drift(node, operations)) else [])

    drifted(["load embedder [1] on n1"])
    clock.advance(30)
    drifted(["load embedder [1] on n1"])  # something outside keeps unloading it
    drifted(["load generator [2] on n1"])
    clock.advance(601)
    drifted(["load generator [2] on n1"])
    drift = AuditEvent.objects.filter(action="node.drift").order_by("created_at", "id")
    assert [e.after["operations"] for e in drift] == [
        ["load embedder [1] on n1"],
        ["load generator [2] on n1"],
        ["load generator [2] on n1"],
    ]
