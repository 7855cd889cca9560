"""Nodes found by Prometheus' targets API: new targets join out of traffic, targets gone for the
grace period depart, returning ones are the same node, and hand-registered nodes stay as they
are. The targets API itself is the boundary here (its JSON as Prometheus writes it); the real
Prometheus is in tests/integration/test_discovery.py."""

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.fleet import polling, tasks
from apps.fleet.discovery import nodes_sync
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool
from apps.fleet.reconcile import node_reconcile
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.fleet.traffic.balancer import drained
from apps.fleet.triton import IndexEntry, ServerMetadata, TritonClient
from apps.registry.models import ModelVersion
from apps.rollouts.proposals import rollout_propose
from tests.support.registry import import_demo
from tests.support.users import bearer

pytestmark = pytest.mark.django_db


def target(name: str, port: int = 8002, pool: str = "gpu", host: str = "10.0.0.5") -> dict:
    """One of the targets API's activeTargets, as Prometheus answers it."""
    return {
        "discoveredLabels": {"__address__": f"{host}:{port}"},
        "labels": {"instance": f"{host}:{port}", "job": "triton", "node": name, "pool": pool},
        "scrapePool": "triton",
        "scrapeUrl": f"http://{host}:{port}/metrics",
        "health": "up",
    }


def events(action: str) -> list[str]:
    return list(AuditEvent.objects.filter(action=action).values_list("target", flat=True))


def test_a_new_target_is_a_node_that_joins_its_pool_out_of_traffic() -> None:
    now = timezone.now()
    found = nodes_sync([target("gpu-7")], now)
    node = Node.objects.get(name="gpu-7")
    assert found.joining == [node.pk] and found.listed == 1
    assert (node.pool.name, node.stage, node.discovered_at, node.listed_at) == (
        "gpu",
        Node.Stage.JOINING,
        now,
        now,
    )
    assert (node.http_url, node.grpc_url, node.metrics_url) == (
        "http://10.0.0.5:8000",
        "10.0.0.5:8001",
        "http://10.0.0.5:8002/metrics",
    )
    assert node.weight == 100 and node.wanted_weight == 0  # no traffic while it joins
    (event,) = AuditEvent.objects.filter(action="node.discover")
    assert (event.actor, event.target, event.after["pool_created"]) == (
        "system:discovery",
        "node:gpu-7",
        True,
    )


def test_ports_come_from_the_targets_labels_where_it_has_them() -> None:
    listed = target("gpu-7", port=9102, host="127.0.0.1")
    listed["labels"] |= {"http_port": "9100", "grpc_port": "9101"}
    nodes_sync([listed], timezone.now())
    node = Node.objects.get()
    assert (node.http_url, node.grpc_url) == ("http://127.0.0.1:9100", "127.0.0.1:9101")


def test_a_port_label_that_is_no_port_is_refused_in_words() -> None:
    listed = target("gpu-7")
    listed["labels"] |= {"http_port": "80/../admin"}
    found = nodes_sync([listed], timezone.now())
    assert found.refused == {
        "http://10.0.0.5:8002/metrics": "label http_port='80/../admin' is not a port (1-65535)"
    }
    assert not Node.objects.exists()


def test_a_target_without_a_name_label_is_named_by_its_address() -> None:
    listed = target("", host="10.1.2.3", port=8002)
    del listed["labels"]["node"]
    nodes_sync([listed], timezone.now())
    assert Node.objects.get().name == "10-1-2-3-8002"


def test_a_target_gone_past_the_grace_period_departs_and_comes_back_as_the_same_node(
    settings: object,
) -> None:
    settings.DISCOVERY_GRACE_S = 60  # type: ignore[attr-defined]
    start = timezone.now()
    nodes_sync([target("gpu-7"), target("gpu-8", port=8012)], start)
    first = Node.objects.get(name="gpu-7")
    Node.objects.update(stage=Node.Stage.SERVING)

    # Not listed: out of traffic at once (a pod stopping), departed after the grace.
    assert nodes_sync([target("gpu-8", port=8012)], start + timedelta(seconds=5)).departed == []
    unlisted = Node.objects.get(name="gpu-7")
    assert (unlisted.stage, unlisted.wanted_weight) == (Node.Stage.SERVING, 0)
    assert nodes_sync([target("gpu-8", port=8012)], start + timedelta(seconds=64)).departed == []
    gone = nodes_sync([target("gpu-8", port=8012)], start + timedelta(seconds=66))
    assert gone.departed == ["gpu-7"]
    departed = Node.objects.get(name="gpu-7")
    assert departed.stage == Node.Stage.DEPARTED and departed.wanted_weight == 0
    (said,) = AuditEvent.objects.filter(action="node.depart")
    assert said.message == "not listed by Prometheus for 66 s (grace 60 s): no longer polled"
    # An empty listing unlists nothing (a misnamed scrape pool would take the fleet out).
    assert nodes_sync([], start + timedelta(seconds=200)).departed == []
    assert Node.objects.get(name="gpu-8").wanted_weight == 100
    other = target("gpu-other", port=8099)
    assert nodes_sync([other], start + timedelta(seconds=200)).departed == []
    assert nodes_sync([other], start + timedelta(seconds=261)).departed == ["gpu-8"]  # once each

    back = nodes_sync([target("gpu-7")], start + timedelta(seconds=300))
    assert back.joining == [first.pk]
    assert Node.objects.get(name="gpu-7").stage == Node.Stage.JOINING
    assert events("node.return") == ["node:gpu-7"]
    assert Node.objects.count() == 3


def test_a_node_listed_again_within_the_grace_gets_its_weight_back() -> None:
    start = timezone.now()
    both = [target("gpu-7"), target("gpu-8", port=8012)]
    nodes_sync(both, start)
    Node.objects.update(stage=Node.Stage.SERVING)
    nodes_sync(both[1:], start + timedelta(seconds=5))
    assert Node.objects.get(name="gpu-7").wanted_weight == 0
    nodes_sync(both, start + timedelta(seconds=10))
    again = Node.objects.get(name="gpu-7")
    assert (again.wanted_weight, again.unlisted_since, again.stage) == (100, None, "serving")


def test_a_listing_that_lost_half_its_targets_for_a_pass_departs_none(settings: object) -> None:
    """Even with no grace at all: a node departs only from a later pass that did not list it
    either, and at most DISCOVERY_DEPARTURES_PER_PASS a pass, the longest unlisted first."""
    settings.DISCOVERY_GRACE_S = 0  # type: ignore[attr-defined]
    settings.DISCOVERY_DEPARTURES_PER_PASS = 2  # type: ignore[attr-defined]
    start = timezone.now()
    listed = [target(f"gpu-{n}", port=8000 + 10 * n) for n in range(6)]
    nodes_sync(listed, start)
    assert nodes_sync(listed[:3], start + timedelta(seconds=5)).departed == []
    assert nodes_sync(listed, start + timedelta(seconds=10)).departed == []
    assert not Node.objects.filter(unlisted_since__isnull=False).exists()
    nodes_sync(listed[:3], start + timedelta(seconds=15))
    departures = [
        nodes_sync(listed[:2], start + timedelta(seconds=second)).departed
        for second in (20, 25, 30)
    ]
    assert departures == [["gpu-3", "gpu-4"], ["gpu-5", "gpu-2"], []]


def test_one_name_listed_by_two_targets_is_neither_s() -> None:
    start = timezone.now()
    nodes_sync([target("gpu-7")], start)
    twice = [target("gpu-7"), target("gpu-7", host="10.6.6.6")]
    found = nodes_sync(twice, start + timedelta(seconds=5))
    why = "node name gpu-7 is listed by 2 targets: none is taken for it"
    assert found.refused == {
        "http://10.0.0.5:8002/metrics": why,
        "http://10.6.6.6:8002/metrics": why,
    }
    node = Node.objects.get()
    assert (node.http_url, node.unlisted_since) == ("http://10.0.0.5:8000", None)
    assert nodes_sync(twice[1:], start + timedelta(seconds=6)).refused == {}  # then it moves


def test_a_node_whose_target_is_still_listed_is_never_re_addressed() -> None:
    start = timezone.now()
    nodes_sync([target("gpu-7")], start)
    relabelled = target("gpu-x")  # the same target, named otherwise now
    found = nodes_sync([relabelled, target("gpu-7", host="10.6.6.6")], start + timedelta(seconds=5))
    assert found.refused["http://10.6.6.6:8002/metrics"] == (
        "node gpu-7's target http://10.0.0.5:8002/metrics is still listed: not re-addressed to "
        "http://10.6.6.6:8002/metrics"
    )
    assert Node.objects.get(name="gpu-7").http_url == "http://10.0.0.5:8000"


def test_a_node_listed_in_another_pool_departs_from_one_and_joins_the_other() -> None:
    start = timezone.now()
    nodes_sync([target("gpu-7")], start)
    Node.objects.update(stage=Node.Stage.SERVING)
    found = nodes_sync([target("gpu-7", pool="cpu")], start + timedelta(seconds=5))
    node = Node.objects.select_related("pool").get()
    assert found.joining == [node.pk]
    assert (node.pool.name, node.stage) == ("cpu", Node.Stage.JOINING)
    trail = AuditEvent.objects.filter(target="node:gpu-7").order_by("id")
    assert [(e.action, e.message) for e in trail][1:] == [
        ("node.depart", "listed in pool cpu now: no longer polled"),
        (
            "node.return",
            "listed again in pool cpu: joins out of traffic until it serves its pool's release",
        ),
    ]


def test_a_target_joins_only_a_pool_open_to_discovery_and_a_protected_one_with_approval(
    client: Client,
) -> None:
    from apps.accounts.roles import Role
    from apps.accounts.services import user_ensure
    from apps.approvals.models import Approval
    from apps.approvals.services import approval_approve
    from tests.support.users import PASSWORD, make_user

    prod = NodePool.objects.create(name="prod", protected=True)
    found = nodes_sync([target("gpu-7", pool="prod")], timezone.now())
    assert found.refused["http://10.0.0.5:8002/metrics"] == (
        "pool prod does not take discovered nodes: a person marks it discoverable (on a "
        "protected pool, with a second person's approval)"
    )
    assert not Node.objects.exists()
    make_user(Role.VIEWER)  # the role groups
    ann, bob = (
        user_ensure(username=name, password=PASSWORD, role=Role.RELEASE_MANAGER)
        for name in ("ann", "bob")
    )
    asked = Client(headers=bearer(ann)).post(
        "/api/pools/prod/discoverable", {"discoverable": True}, content_type="application/json"
    )
    assert asked.status_code == 202
    assert nodes_sync([target("gpu-7", pool="prod")], timezone.now()).joining == []
    approval_approve(approval_id=Approval.objects.get().pk, actor=bob)
    prod.refresh_from_db()
    assert prod.discoverable
    joined = nodes_sync([target("gpu-7", pool="prod")], timezone.now()).joining
    assert joined == [Node.objects.get(name="gpu-7").pk]


def test_a_target_listed_again_changes_nothing_and_writes_nothing_but_when() -> None:
    start = timezone.now()
    nodes_sync([target("gpu-7")], start)
    Node.objects.update(stage=Node.Stage.SERVING)
    again = nodes_sync([target("gpu-7")], start + timedelta(seconds=5))
    assert again.joining == [] and again.departed == []
    node = Node.objects.get()
    assert (node.stage, node.listed_at) == (Node.Stage.SERVING, start + timedelta(seconds=5))
    assert AuditEvent.objects.count() == 1  # the discovery only


def test_a_pod_replaced_at_another_address_under_its_name_joins_again() -> None:
    start = timezone.now()
    nodes_sync([target("gpu-7")], start)
    Node.objects.update(stage=Node.Stage.SERVING)
    moved = nodes_sync([target("gpu-7", host="10.0.0.9")], start + timedelta(seconds=5))
    node = Node.objects.get()
    assert moved.joining == [node.pk]
    assert (node.stage, node.http_url) == (Node.Stage.JOINING, "http://10.0.0.9:8000")
    (event,) = AuditEvent.objects.filter(action="node.return")
    assert event.message.startswith("listed at other addresses")


def by_hand(name: str) -> None:
    """`name` registered by hand (`register_node`), at an address of its own."""
    node_register(
        name=name,
        pool="gpu",
        http_url="http://10.0.0.1:8000",
        grpc_url="",
        metrics_url="",
        actor="system:test",
    )


def test_a_node_registered_by_hand_is_never_touched_by_discovery() -> None:
    by_hand("gpu-7")
    found = nodes_sync([target("gpu-7")], timezone.now())
    assert found.refused == {"http://10.0.0.5:8002/metrics": "node gpu-7 was registered by hand"}
    nodes_sync([], timezone.now() + timedelta(days=1))
    node = Node.objects.get()
    assert (node.stage, node.http_url) == (Node.Stage.SERVING, "http://10.0.0.1:8000")


def test_a_discovered_node_is_never_registered_again_by_hand() -> None:
    # Its addresses follow its target: changed by hand, the next pass would change them back;
    # departed, it rejoins as itself when its target is listed again.
    now = timezone.now()
    nodes_sync([target("gpu-7")], now)
    with pytest.raises(FleetError, match=r"node gpu-7 is discovered from .* under another name"):
        by_hand("gpu-7")
    for later in (1, 2):  # unlisted, then departed
        nodes_sync([target("gpu-8", port=8012)], now + timedelta(days=later))
    with pytest.raises(FleetError, match=r"node gpu-7 is discovered, departed, from Prometheus"):
        by_hand("gpu-7")
    node = Node.objects.get(name="gpu-7")
    assert (node.http_url, node.discovered_at is not None) == ("http://10.0.0.5:8000", True)
    refused = AuditEvent.objects.filter(action="node.register")
    assert {(e.result, e.target) for e in refused} == {("failed", "node:gpu-7")}


def test_a_target_that_is_no_node_is_said_once_with_why() -> None:
    unlabelled = target("gpu-7")
    del unlabelled["labels"]["pool"]
    metadata = target("gpu-8", host="169.254.169.254")
    for _ in range(3):
        found = nodes_sync([unlabelled, metadata], timezone.now())
    assert found.refused["http://10.0.0.5:8002/metrics"] == "no 'pool' label: which pool is it in?"
    assert "169.254.169.254" in found.refused["http://169.254.169.254:8002/metrics"]
    assert not Node.objects.exists()
    failed = AuditEvent.objects.filter(action="node.discover", result="failed")
    assert failed.count() == 2  # each once, not once a pass


def test_a_pass_costs_the_same_statements_at_5_and_at_50_nodes() -> None:
    """Nodes listed again, and as many targets that are no node (no pool label)."""

    def statements(count: int) -> int:
        listed = [target(f"n{count}-{i}", port=8002 + i) for i in range(count)]
        for i in range(count):
            unlabelled = target(f"x{count}-{i}", port=9002 + i)
            del unlabelled["labels"]["pool"]
            listed.append(unlabelled)
        nodes_sync(listed, timezone.now())  # found or refused: events of their own, once
        with CaptureQueriesContext(connection) as queries:
            nodes_sync(listed, timezone.now())
        return len(queries)

    assert statements(5) == statements(50)


def test_nodes_listed_as_before_are_neither_held_nor_resolved_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass over 5,000 nodes that held them all locked held back every worker's reconcile
    until it ended, and it resolved 15,000 names; a node's addresses are checked when it joins (and
    at each connection: addresses.pinned)."""
    from apps.fleet import addresses

    resolved: list[str] = []
    lookup = addresses._lookup
    monkeypatch.setattr(addresses, "_lookup", lambda host: resolved.append(host) or lookup(host))
    listed = [target(f"gpu-{i}", port=8002 + i) for i in range(3)]
    nodes_sync(listed, timezone.now())
    assert len(resolved) == 3 * 3  # http, gRPC and metrics addresses of each
    resolved.clear()
    moved = [*listed[:2], target("gpu-2", port=8002, host="10.0.0.9")]
    with CaptureQueriesContext(connection) as queries:
        again = nodes_sync(moved, timezone.now())
    assert again.joining == [Node.objects.get(name="gpu-2").pk]
    assert resolved == ["10.0.0.9"] * 3  # the moved node's only
    if connection.vendor != "postgresql":
        return  # row locks are PostgreSQL's
    # The nodes listed as before, only to note them, first, in a transaction of their own; then,
    # while the pass works, the moved node alone (none is gone: no departure to lock).
    locking = [q["sql"] for q in queries if "FOR UPDATE" in q["sql"]]
    assert len(locking) == 2, locking
    pks = dict(Node.objects.values_list("name", "pk"))
    assert f'"fleet_node"."id" IN ({pks["gpu-0"]}, {pks["gpu-1"]})' in locking[0]
    assert f'"fleet_node"."id" IN ({pks["gpu-2"]})' in locking[1]


def test_a_departed_node_is_neither_polled_nor_reconciled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes_sync([target("gpu-7"), target("gpu-8", port=8012)], timezone.now())
    Node.objects.filter(name="gpu-7").update(stage=Node.Stage.DEPARTED)
    sent: list[object] = []
    monkeypatch.setattr(tasks, "send_to", lambda queue, task, nodes, **_: sent.append(nodes))
    tasks.poll_nodes()
    tasks.reconcile_all()
    listed = Node.objects.get(name="gpu-8").pk
    assert sent == [listed, [listed]]  # a poll of its own, a reconcile in a chunk
    # A reconcile sent before it departed (a release's chunk) neither reads it nor plans for it.
    read: list[str] = []
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: read.append("index") or [])
    assert node_reconcile(node_id=Node.objects.get(name="gpu-7").pk) == [] and read == []


@pytest.fixture
def joining(monkeypatch: pytest.MonkeyPatch) -> Node:
    """gpu-7 found, its pool to serve embedder v1; Triton's answers are the boundary."""
    import_demo()
    nodes_sync([target("gpu-7")], timezone.now())
    deployment_set(
        model_name="embedder", version=1, pool=NodePool.objects.get(), actor="system:test"
    )
    monkeypatch.setattr(TritonClient, "health", lambda self: "ready")
    monkeypatch.setattr(polling, "read_metrics", lambda url, node: "")  # no GPUs
    monkeypatch.setattr(TritonClient, "server_metadata", lambda self: ServerMetadata("2.51.0", []))
    return Node.objects.get()


def index(*entries: tuple[str, int, str]) -> object:
    return lambda self: [IndexEntry(m, v, state, "") for m, v, state in entries]


def test_a_joining_node_serves_only_once_its_release_reads_back_ready(
    joining: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TritonClient, "repository_index", index())
    assert node_reconcile(node_id=joining.pk)  # its load planned
    joining.operations.update(status="succeeded")
    monkeypatch.setattr(TritonClient, "repository_index", index(("embedder", 1, "LOADING")))
    node_reconcile(node_id=joining.pk)
    assert Node.objects.get().stage == Node.Stage.JOINING

    monkeypatch.setattr(TritonClient, "repository_index", index(("embedder", 1, "READY")))
    assert node_reconcile(node_id=joining.pk) == []
    node = Node.objects.get()
    assert (node.stage, node.wanted_weight) == (Node.Stage.SERVING, 100)
    (joined,) = AuditEvent.objects.filter(action="node.join")
    assert joined.after["serving"] == {"embedder": [1]}
    assert joined.message.startswith("takes traffic ")


def test_a_joining_node_that_is_not_ready_waits(
    joining: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TritonClient, "repository_index", index(("embedder", 1, "READY")))
    monkeypatch.setattr(TritonClient, "health", lambda self: "live")
    node_reconcile(node_id=joining.pk)
    assert Node.objects.get().stage == Node.Stage.JOINING


def test_a_joining_node_is_polled_in_full_before_its_plan_and_joins_right_after_its_run(
    joining: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its health and metadata are read with its index before anything is planned (no poll task
    of its own is needed); once its loads have run, a read of its health and index decides
    whether it serves (what it read is recorded with its stage): no second plan, no second
    poll, no index read more than that one."""
    loaded: list[str] = []
    reads: list[str] = []

    def repository_index(self: TritonClient) -> list[IndexEntry]:
        reads.append("index")
        return [IndexEntry(m, 1, "READY", "") for m in loaded]

    def server_metadata(self: TritonClient) -> ServerMetadata:
        reads.append("metadata")
        return ServerMetadata("2.51.0", [])

    monkeypatch.setattr(TritonClient, "repository_index", repository_index)
    monkeypatch.setattr(TritonClient, "server_metadata", server_metadata)
    monkeypatch.setattr(TritonClient, "load", lambda self, model, **_: loaded.append(model))
    tasks.reconcile_nodes([joining.pk])
    node = Node.objects.get()
    assert (node.stage, node.health, node.triton_version) == (Node.Stage.SERVING, "ready", "2.51.0")
    assert node.index == [{"model": "embedder", "version": 1, "state": "READY", "reason": ""}]
    assert loaded == ["embedder"]
    # The plan's poll, the load's read-back, the read it joins by.
    assert reads == ["metadata", "index", "index", "index"]
    (joined,) = AuditEvent.objects.filter(action="node.join")
    assert joined.after["serving"] == {"embedder": [1]}


def test_draining_a_joining_node_never_waits_for_the_pools_minimum(joining: Node) -> None:
    """It serves nobody yet: its loads go ahead even on a pool at its minimum."""
    pool = joining.pool
    pool.traffic, pool.traffic_runtime, pool.min_serving = "haproxy", "127.0.0.1:1", 1
    pool.traffic_backends = "triton_http"
    pool.save()
    joining.refresh_from_db()
    entered = []
    with drained(joining):  # no PoolAtCapacity; the balancer (refused port 1) is recorded
        entered.append(True)
    assert entered and "127.0.0.1:1" in Node.objects.get().traffic_error


def test_the_nodes_page_shows_joining_and_departed_nodes_apart(
    client: Client, viewer: User
) -> None:
    now = timezone.now()
    nodes_sync([target("gpu-7"), target("gpu-8", port=8012), target("gpu-9", port=8022)], now)
    Node.objects.filter(name="gpu-8").update(stage=Node.Stage.SERVING, health="ready")
    Node.objects.filter(name="gpu-9").update(stage=Node.Stage.DEPARTED, health="unreachable")
    client.force_login(viewer)
    page = client.get("/nodes/").content.decode()
    assert "3 nodes" not in page  # a departed node is no longer one of the pool's
    assert "2 nodes: 1 ready, 0 unreachable, 0 drifting, 1 joining; 1 departed." in page
    assert 'class="badge stage-joining"' in page and 'class="badge stage-departed"' in page
    joining = client.get("/nodes/?stage=joining").content.decode()
    assert 'id="node-gpu-7"' in joining and 'id="node-gpu-8"' not in joining
    assert "nothing to load" in joining  # where it is: its pool deploys nothing


def test_a_rollout_and_a_deployments_progress_count_only_the_nodes_that_serve(
    client: Client, viewer: User
) -> None:
    """A node joining, quarantined or departed is no canary and holds no rollout back; a
    departed one holds no deployment back either."""
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    listed = [target(f"gpu-{i}", port=8002 + 10 * i) for i in range(5)]
    nodes_sync(listed, timezone.now())
    pool = NodePool.objects.get()
    stages = [Node.Stage.SERVING] * 2 + [Node.Stage.JOINING, Node.Stage.QUARANTINED]
    for i, stage in enumerate([*stages, Node.Stage.DEPARTED]):
        Node.objects.filter(name=f"gpu-{i}").update(stage=stage)
    deployment_set(model_name="embedder", version=1, pool=pool, actor="system:test")
    proposal = rollout_propose(
        model_name="embedder", pool_name="gpu", canary_version=2, plan="50%", analysis=None
    )
    assert proposal.preview[0].canary_nodes + proposal.preview[0].baseline_nodes == [
        "gpu-0",
        "gpu-1",
    ]
    client.force_login(viewer)
    (progress,) = client.get("/api/deployments", headers=bearer(viewer)).json()
    assert [n["node"] for n in progress["nodes"]] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]


@pytest.mark.django_db(transaction=True)
def test_a_pass_that_departs_a_node_never_deadlocks_with_a_reconciles_index_write(
    monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    """What a 5,000-node release met: a pass locked a departing node (G), then the listed ones
    (L among them) one by one; a chunk's reconcile, writing the indexes it read of L and G,
    locked L and waited for G; PostgreSQL failed one of them, and the chunk was lost. Here a
    third holder of G lines them up that way: the pass waits for G first, the write second.
    Every locker of several nodes now takes them at once, in id order (Node.objects.lock)."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks: PostgreSQL's")
    nodes_sync([target("l", port=8002), target("g", port=8003)], timezone.now())
    Node.objects.update(stage=Node.Stage.SERVING)  # their reconcile reads only their indexes
    listed, gone = Node.objects.get(name="l"), Node.objects.get(name="g")
    assert listed.pk < gone.pk  # the order the index write's scan met them in, too
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    settings.DISCOVERY_GRACE_S = 0  # type: ignore[attr-defined]
    nodes_sync([target("l", port=8002)], timezone.now())  # g unlisted: the next pass departs it
    held, release, errors = threading.Event(), threading.Event(), []

    def hold_gone() -> None:
        with transaction.atomic():
            Node.objects.filter(pk=gone.pk).lock()
            held.set()
            release.wait(10)

    def run(work: Callable[[], object]) -> threading.Thread:
        def guarded() -> None:
            try:
                work()
            except Exception as exc:  # the deadlock, said by the assertion below
                errors.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=guarded)
        thread.start()
        return thread

    def waiting(count: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
                if cursor.fetchone()[0] >= count:
                    return
            time.sleep(0.02)
        pytest.fail(f"{count} lockers never waited")

    holder = run(hold_gone)
    assert held.wait(10)
    passing = run(lambda: nodes_sync([target("l", port=8002)], timezone.now()))
    waiting(1)
    writing = run(lambda: polling.nodes_read_index([listed.pk, gone.pk]))
    waiting(2)
    release.set()
    for thread in (holder, passing, writing):
        thread.join(20)
    assert errors == []
    assert Node.objects.get(pk=gone.pk).stage == Node.Stage.DEPARTED
    assert Node.objects.get(pk=listed.pk).last_seen is not None
