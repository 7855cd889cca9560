"""Nodes that come and go on their own: a fourth real Triton node started under traffic is
found by the real worker and beat in a real Prometheus' targets API (file_sd); labelled with a
protected pool, it gets nothing until a second person opens the pool to discovery; then it joins
behind a real HAProxy out of traffic, is loaded and warmed, and takes its share; stopped
(SIGTERM, as a pod is) under traffic, it costs no request, departs once the grace period has
passed, and its HAProxy server is deleted."""

import urllib.request
from collections.abc import Callable

import pytest

from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.accounts.services import user_ensure
from apps.approvals.services import approval_approve, approval_request
from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.selectors import NodeFilters, node_search
from apps.fleet.services.pools import pool_set_discoverable, pool_set_protected
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
from tests.support.users import PASSWORD, make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def requests_answered(state: FleetState, proc: Proc) -> int:
    """Inference requests the node answered, any model: Triton's own counter."""
    url = f"http://127.0.0.1:{proc.ports['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in lines
        if line.startswith("nv_inference_request_success{")
    )


def approved_after_a_look(state: FleetState, haproxy: Proc) -> Callable[[Proc], None]:
    """The pool opened to discovery by two people, once a pass refused the node and it had no
    request at all."""

    def held(proc: Proc) -> None:
        refused = AuditEvent.objects.filter(
            action="node.discover", target_name__contains=str(proc.ports["metrics"])
        )
        wait_for(f"discovery refuses {proc.name}", refused.exists, timeout=30, interval=0.2)
        assert refused.get().message.startswith("pool trio does not take discovered nodes")
        assert not Node.objects.filter(name=proc.name).exists()
        assert runtime(haproxy).weights("triton_http").get(proc.name) is None
        assert requests_answered(state, proc) == 0
        make_user(Role.VIEWER)  # the role groups
        ann, bob = (
            user_ensure(username=name, password=PASSWORD, role=Role.RELEASE_MANAGER)
            for name in ("ann", "bob")
        )
        try:
            pool_set_discoverable(pool_name="trio", discoverable=True, actor=ann)
        except ApprovalRequired as asked:
            approval = approval_request(refused=asked, actor=ann)
        else:
            raise AssertionError("a protected pool was opened by one person")
        approval_approve(approval_id=approval.pk, actor=bob)

    return held


def test_a_node_started_under_traffic_joins_warmed_and_departs_once_gone(
    discovering: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    devfleet, state = trio
    pool_set_protected(pool_name="trio", protected=True, actor="system:test")
    pool_set_discoverable(pool_name="trio", discoverable=False, actor="system:test")
    through = f"http://127.0.0.1:{haproxy.ports['http']}"
    with recording(through, rps=10) as users:
        joined = join_watched(devfleet, haproxy, "trio", approved_after_a_look(state, haproxy))
        name = joined.proc.name
        wait_for(f"{name} answers users", lambda: answered_through(haproxy, name) >= 5)
    print(f"\n{name}: {joined.listed_to_serving_s:.1f} s from Prometheus listing it to serving")
    assert users.failed == 0 and len(users.sent) > 50
    # Warmed before its share: Triton answered the warm-up beyond what HAProxy sent it.
    relayed = answered_through(haproxy, name)
    counts = counted([joined.proc], state, "rag_pipeline", 1, relayed + discovering.warmup_requests)
    assert counts[1] - relayed == discovering.warmup_requests

    with recording(through, rps=10) as users:
        devfleet.remove_node(name)  # unlisted and stopped at once, as a pod scaled away
        wait_for(f"{name} departs", lambda: Node.objects.get(name=name).stage == "departed", 60)
    assert users.failed == 0 and len(users.sent) > DISCOVERY_GRACE_S * 10 / 2
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
    assert AuditEvent.objects.filter(action="node.discover", target=f"node:{name}").count() == 1
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
