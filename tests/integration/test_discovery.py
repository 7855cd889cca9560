"""Nodes that come and go on their own: a fourth real Triton node started under traffic is
found by the real worker and beat in a real Prometheus' targets API (file_sd), joins behind a
real HAProxy out of traffic, is loaded and warmed, then takes its share; stopped, it departs
once the grace period has passed, and its HAProxy server is deleted."""

import pytest

from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.selectors import NodeFilters, node_search
from tests.support.fleet import (
    STEPS_V1,
    answered_through,
    counted,
    join_watched,
    recording,
    runtime,
    wait_for,
)
from tests.support.services_fixtures import DISCOVERY_GRACE_S

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_node_started_under_traffic_joins_warmed_and_departs_once_gone(
    discovering: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    devfleet, state = trio
    with recording(f"http://127.0.0.1:{haproxy.ports['http']}", rps=10) as users:
        joined = join_watched(devfleet, haproxy, "trio")
        name = joined.proc.name
        wait_for(f"{name} answers users", lambda: answered_through(haproxy, name) >= 5)
    print(f"\n{name}: {joined.listed_to_serving_s:.1f} s from Prometheus listing it to serving")

    assert users.failed == 0 and len(users.sent) > 50
    # Out of traffic while it joined: HAProxy had it at weight 0 (or not yet at all).
    assert joined.weights_while_joining
    assert set(joined.weights_while_joining) <= {None, 0}
    node = Node.objects.get(name=name)
    assert node.discovered_at is not None and node.pool == discovering
    loads = Operation.objects.filter(node=node, status=Operation.Status.SUCCEEDED)
    assert {(op.model_name, v) for op in loads for v in op.versions} == STEPS_V1
    join = AuditEvent.objects.get(action="node.join", target=f"node:{name}")
    assert join.created_at >= max(op.finished_at for op in loads)
    assert join.after["serving"]["rag_pipeline"] == [1]
    # Warmed before its share: Triton answered the warm-up beyond what HAProxy sent it.
    relayed = answered_through(haproxy, name)
    counts = counted([joined.proc], state, "rag_pipeline", 1, relayed + discovering.warmup_requests)
    warmed = counts[1] - relayed
    assert warmed == discovering.warmup_requests
    assert AuditEvent.objects.filter(action="node.discover", target=f"node:{name}").count() == 1

    devfleet.remove_node(name)
    wait_for(f"{name} departs", lambda: Node.objects.get(name=name).stage == "departed", 60)
    # Gone for the grace period since the last pass that listed it: counted from that pass, not
    # from the removal, which may come up to a pass later.
    gone = Node.objects.get(name=name)
    assert gone.listed_at and gone.stage_changed_at
    assert (gone.stage_changed_at - gone.listed_at).total_seconds() >= DISCOVERY_GRACE_S
    summary = node_search(NodeFilters(pool="trio")).summary
    assert (summary.nodes, summary.departed, summary.unreachable) == (3, 1, 0)
    wait_for(
        f"HAProxy no longer has {name} as a server",
        lambda: name not in runtime(haproxy).weights("triton_http"),
    )
