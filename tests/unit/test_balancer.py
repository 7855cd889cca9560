"""A pool's traffic, with the balancer stubbed at its boundary (what it holds and answers); the
same paths run against a real HAProxy in tests/integration/test_traffic.py."""

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from apps.audit.models import AuditEvent
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.runner import node_run
from apps.fleet.services.pools import pool_set_traffic
from apps.fleet.traffic import balancer as balancing
from apps.fleet.traffic import warmup
from apps.fleet.traffic.balancer import (
    BalancerError,
    PoolAtCapacity,
    Synced,
    drained,
    pool_sync,
    share_weights,
    traffic_sync,
)
from apps.fleet.traffic.haproxy import Server
from apps.fleet.traffic.warmup import warm_up
from apps.fleet.triton import IndexEntry, Reply, Session, TritonClient, TritonError
from apps.registry.models import Model as RegistryModel
from apps.rollouts.models import Rollout
from apps.rollouts.services import rollout_abort


@given(
    percent=st.integers(1, 99),
    total=st.integers(2, 500),
)
def test_weights_give_the_share_asked_on_as_many_nodes_as_it_rounds_up_to(
    percent: int, total: int
) -> None:
    canary = min(total, math.ceil(total * percent / 100))
    each, rest = share_weights(percent, canary, total)
    assert 1 <= each <= 256 and 1 <= rest <= 256
    if canary < total:
        share = 100 * canary * each / (canary * each + (total - canary) * rest)
        assert abs(share - percent) < 0.5


def test_small_pools_get_readable_exact_weights() -> None:
    assert share_weights(10, 1, 3) == (22, 99)  # 22 / (22 + 2 x 99) = 10 %
    assert share_weights(5, 1, 3) == (10, 95)
    assert share_weights(50, 2, 3) == (50, 100)
    assert share_weights(100, 3, 3) == (100, 100)


@dataclass
class Balancer:
    """Holds servers' weights as HAProxy would; `busy` is what in_flight answers, in turn."""

    weights: dict[str, int]
    busy: list[int] = field(default_factory=list)
    down: bool = False

    def sync(
        self, wanted: dict[str, int], places: dict[str, balancing.Place], gone: set[str]
    ) -> Synced:
        self.placed = places
        if self.down:
            raise BalancerError("HAProxy runtime API at 10.0.0.9:9999: connection refused")
        self.weights |= {n: wanted[n] for n in places if n in wanted and n not in self.weights}
        self.weights = {n: w for n, w in self.weights.items() if n not in gone}  # deleted
        changed = {n: self.weights[n] for n, w in wanted.items() if self.weights.get(n, w) != w}
        self.weights |= {n: wanted[n] for n in changed}
        lacking = {n: "not a server of HAProxy backend triton_http" for n in wanted}
        problems = {n: why for n, why in lacking.items() if n not in self.weights}
        return Synced(dict(self.weights), changed, problems)

    def in_flight(self, node: str) -> int:
        return self.busy.pop(0) if self.busy else 0


@pytest.fixture
def balancer(db: None, monkeypatch: pytest.MonkeyPatch) -> Balancer:
    pool = NodePool.objects.create(
        name="gpu", traffic=NodePool.Traffic.HAPROXY, min_serving=2, drain_timeout_s=1
    )
    held = timezone.now() + timedelta(hours=1)  # a worker holds each node, as while it loads
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        Node.objects.create(
            name=name, pool=pool, http_url="http://x:8000", health="ready", lease_until=held
        )
    stub = Balancer(dict.fromkeys(["gpu-1", "gpu-2", "gpu-3"], 100))
    monkeypatch.setattr(balancing, "balancer", lambda pool: stub if pool.traffic else None)
    return stub


def node(name: str) -> Node:
    return Node.objects.select_related("pool").get(name=name)


def test_a_node_is_out_of_traffic_while_it_loads_then_back_at_its_weight(
    balancer: Balancer,
) -> None:
    balancer.busy = [2, 1]  # two requests, then one, still in flight: it waits for them
    with drained(node("gpu-1")):
        assert balancer.weights == {"gpu-1": 0, "gpu-2": 100, "gpu-3": 100}
        assert not balancer.busy
    assert balancer.weights["gpu-1"] == 100 and not node("gpu-1").draining
    event = AuditEvent.objects.get(action="node.drain")
    assert (event.target, event.result) == ("node:gpu-1", "ok")


def test_the_pool_keeps_its_serving_nodes_and_a_node_without_share_needs_none(
    balancer: Balancer,
) -> None:
    with drained(node("gpu-1")):
        refused = pytest.raises(PoolAtCapacity, match="keeps 2 nodes serving and 1 other does")
        with refused, drained(node("gpu-2")):
            pytest.fail("two of three nodes drained at once")
        assert "keeps 2 nodes serving" in node("gpu-2").traffic_error
        Node.objects.filter(name="gpu-3").update(weight=0)  # a canary being rolled back
        with drained(node("gpu-3")):
            assert balancer.weights == {"gpu-1": 0, "gpu-2": 100, "gpu-3": 0}
    assert balancer.weights == {"gpu-1": 100, "gpu-2": 100, "gpu-3": 0}


def test_requests_that_outlast_the_drain_timeout_are_recorded(balancer: Balancer) -> None:
    balancer.busy = [1] * 100
    with drained(node("gpu-1")):
        pass
    event = AuditEvent.objects.get(action="node.drain")
    assert event.result == "failed"
    assert "requests still in flight after 1 s" in event.message


def test_a_drain_whose_worker_is_gone_ends_at_the_next_sync(balancer: Balancer) -> None:
    expired = timezone.now() - timedelta(seconds=1)
    Node.objects.filter(name="gpu-1").update(draining=True, lease_until=expired)
    Node.objects.filter(name="gpu-2").update(draining=True)
    traffic_sync(node("gpu-1").pool_id)
    assert balancer.weights == {"gpu-1": 100, "gpu-2": 0, "gpu-3": 100}


def test_weights_changed_behind_our_back_are_put_back_and_recorded_as_drift(
    balancer: Balancer,
) -> None:
    Node.objects.filter(name="gpu-1").update(weight=22)
    balancer.weights |= {"gpu-1": 22}
    pool_id = node("gpu-1").pool_id
    pool_sync(pool_id)
    assert not AuditEvent.objects.exists()  # nothing differed
    balancer.weights = dict.fromkeys(balancer.weights, 100)  # HAProxy restarted
    pool_sync(pool_id)
    assert balancer.weights["gpu-1"] == 22
    drift = AuditEvent.objects.get(action="pool.traffic_drift")
    assert (drift.before, drift.after) == ({"weights": {"gpu-1": 100}}, {"weights": {"gpu-1": 22}})
    assert node("gpu-1").served_weight == 22


def test_a_node_the_balancer_lacks_or_a_balancer_away_is_shown_on_the_nodes(
    balancer: Balancer,
) -> None:
    del balancer.weights["gpu-3"]
    pool_id = node("gpu-1").pool_id
    traffic_sync(pool_id)
    assert node("gpu-3").traffic_error == "not a server of HAProxy backend triton_http"
    assert node("gpu-3").served_weight is None and node("gpu-1").served_weight == 100
    balancer.down = True
    traffic_sync(pool_id)
    assert all("connection refused" in n.traffic_error for n in Node.objects.all())


def test_a_joining_node_is_given_weight_0_and_its_place_so_the_balancer_can_add_it(
    balancer: Balancer,
) -> None:
    """Only nodes found by discovery are placed: a node registered by hand is the balancer's
    configuration's to hold."""
    gpu4 = Node.objects.create(
        name="gpu-4",
        pool=node("gpu-1").pool,
        http_url="http://10.0.0.4:8000",
        grpc_url="10.0.0.4:8001",
        stage=Node.Stage.JOINING,
        discovered_at=timezone.now(),
    )
    traffic_sync(gpu4.pool_id)
    assert balancer.weights["gpu-4"] == 0
    assert balancer.placed == {"gpu-4": balancing.Place("10.0.0.4:8000", "10.0.0.4:8001")}
    Node.objects.filter(pk=gpu4.pk).update(stage=Node.Stage.SERVING)
    traffic_sync(gpu4.pool_id)
    assert balancer.weights["gpu-4"] == 100
    Node.objects.filter(pk=gpu4.pk).update(stage=Node.Stage.DEPARTED)
    traffic_sync(gpu4.pool_id)
    assert "gpu-4" not in balancer.weights  # its server deleted: no pile of departed ones
    assert node("gpu-4").traffic_error == ""


def test_a_pools_grpc_backends_are_marked_and_named_without_the_mark() -> None:
    pool = NodePool(traffic_backends="triton_http, triton_grpc:grpc")
    assert (pool.backends, pool.grpc_backends) == (["triton_http", "triton_grpc"], {"triton_grpc"})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"traffic": "nginx"}, "traffic 'nginx': one of '', 'haproxy'"),
        ({"traffic": "haproxy", "backends": ["a b"]}, "backends: name the HAProxy backends"),
        ({"traffic": "haproxy", "backends": []}, "backends: name the HAProxy backends"),
        ({"traffic": "haproxy", "backends": ["be:http"]}, "backends: name the HAProxy backends"),
        (
            {"traffic": "haproxy", "backends": ["be"], "runtime": "127.0.0.1:1"},
            "HAProxy runtime API at 127.0.0.1:1: .*refused",
        ),
        ({"traffic": "haproxy", "backends": ["be"], "runtime": "nowhere"}, "neither host:port"),
        ({"traffic": "", "min_serving": -1}, "min_serving and warmup_requests: 0-1000"),
    ],
)
def test_a_traffic_setting_that_cannot_work_is_refused_with_why(
    db: None, given: dict[str, object], message: str
) -> None:
    NodePool.objects.create(name="gpu")
    with pytest.raises(FleetError, match=message):
        pool_set_traffic(pool_name="gpu", actor="ops", **given)  # type: ignore[arg-type]
    assert NodePool.objects.get().traffic == ""


def test_what_a_node_just_loaded_is_warmed_on_the_node_itself_once_per_pipeline(
    balancer: Balancer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[str, str]] = []

    class Client:  # Triton, at the client's boundary
        def __init__(self, node: str) -> None:
            self.node = node

        @classmethod
        def of(cls, node: Node) -> "Client":
            return cls(node.name)

        def model_inputs(self, model: str) -> list[tuple[str, str, list[int]]]:
            if model == "broken":
                raise TritonError(self.node, "model 'broken' is not ready")
            return [("TEXT", "BYTES", [-1, 1])]

        @contextmanager
        def session(self, timeout: float | None = None) -> Iterator["Client"]:
            yield self

        def reply(self, model: str, inputs: dict[str, object], version: int | None = None) -> Reply:
            sent.append((self.node, model))
            return Reply({})

    monkeypatch.setattr(warmup, "TritonClient", Client)
    NodePool.objects.update(warmup_requests=2)
    pipeline = {"ensemble_scheduling": {"step": [{"model_name": "embedder"}]}}
    warm_up(
        node("gpu-1"),
        {
            "embedder": {},  # warmed through the pipeline it was loaded with
            "rag": pipeline,
            "own": {"model_warmup": [{"name": "w", "batch_size": 1}]},  # Triton warmed it
            "broken": None,
        },
    )
    assert sent == [("gpu-1", "rag"), ("gpu-1", "rag")]
    failed = AuditEvent.objects.get(action="node.warm_up")
    assert (failed.target, failed.result) == ("node:gpu-1:broken", "failed")
    assert "model 'broken' is not ready" in failed.message


def test_a_load_is_warmed_where_its_node_left_traffic_for_it_and_only_there(
    balancer: Balancer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drained for a load, a node is warmed before it takes traffic again; on a pool without a
    traffic strategy it never left, and nothing is sent but the load."""
    sent: list[str] = []
    ready = [IndexEntry("embedder", 1, "READY", "")]
    monkeypatch.setattr(TritonClient, "load", lambda self, model, **_: sent.append("load"))
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: ready)
    monkeypatch.setattr(TritonClient, "model_inputs", lambda self, m: [("TEXT", "BYTES", [-1])])

    def reply(self: Session, model: str, inputs: object, **_: object) -> Reply:
        sent.append(model)
        return Reply({})

    monkeypatch.setattr(Session, "reply", reply)
    NodePool.objects.update(warmup_requests=2)
    gpu_1 = node("gpu-1")
    Node.objects.filter(pk=gpu_1.pk).update(lease_until=None)  # no worker at it
    for traffic in (NodePool.Traffic.HAPROXY, ""):
        NodePool.objects.update(traffic=traffic)
        sent.clear()
        Operation.objects.create(
            node=gpu_1, kind="load", model_name="embedder", versions=[1], requested_by="ops"
        )
        node_run(node_id=gpu_1.pk)
        assert Operation.objects.filter(status="succeeded").count() == (2 if traffic == "" else 1)
        assert sent == (["load", "embedder", "embedder"] if traffic else ["load"])
    assert AuditEvent.objects.filter(action="node.drain").count() == 1


def _free(*rows: tuple[Any, int]) -> bool:
    """Whether another connection may lock these rows at once: nobody holds any of them."""
    free: list[bool] = []

    def probe() -> None:
        try:
            with transaction.atomic():
                for model, pk in rows:
                    list(model.objects.select_for_update(nowait=True).filter(pk=pk))
            free.append(True)
        except DatabaseError:
            free.append(False)
        finally:
            connection.close()

    prober = threading.Thread(target=probe)
    prober.start()
    prober.join()
    return free[0]


@pytest.mark.django_db(transaction=True)
def test_the_balancer_is_never_asked_while_a_row_lock_is_held(
    balancer: Balancer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow balancer must not hold up a person's pause or abort of a rollout, nor a change of
    the pool or a node: its rollout's weights go to it once the abort has committed."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (SQLite locks the whole file)")
    pool = node("gpu-1").pool
    rollout = Rollout.objects.create(
        model=RegistryModel.objects.create(name="rag"),
        pool=pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 10}, {"percent": 100}],
        state=Rollout.State.PROGRESSING,
        canary_nodes=["gpu-1"],
        started_by="ann",
    )
    rows = [(NodePool, pool.pk), (Rollout, rollout.pk), *((Node, n.pk) for n in pool.nodes.all())]
    asked: list[bool] = []
    sync = balancer.sync

    def watched(
        wanted: dict[str, int], places: dict[str, balancing.Place], gone: set[str]
    ) -> Synced:
        asked.append(_free(*rows))
        return sync(wanted, places, gone)

    monkeypatch.setattr(balancer, "sync", watched)
    rollout_abort(rollout_id=rollout.pk, actor="release-manager", reason="wrong answers")
    assert balancer.weights["gpu-1"] == 0  # out of traffic as soon as the abort committed
    with drained(node("gpu-1")):
        pass
    pool_sync(pool.pk)
    assert len(asked) == 4 and all(asked), asked


def test_a_sync_between_a_change_and_its_own_sync_takes_it_for_no_drift(
    balancer: Balancer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight committed whose own sync is still to come (it runs after the commit) differs
    from what the balancer has, yet nobody else changed it: drift is a weight other than the
    one last read back there."""
    pool = node("gpu-1").pool
    traffic_sync(pool.pk)  # read back once: what the balancer serves is known
    with monkeypatch.context() as later:
        later.setattr(balancing, "traffic_sync", lambda pool_id: {})  # its own sync, not yet
        balancing.weights_set(pool, {"gpu-1": 22}, "release")
    pool_sync(pool.pk)  # the periodic sync comes first
    assert balancer.weights["gpu-1"] == 22
    assert not AuditEvent.objects.filter(action="pool.traffic_drift").exists()
    balancer.weights["gpu-2"] = 7  # someone else, by hand
    pool_sync(pool.pk)
    drift = AuditEvent.objects.get(action="pool.traffic_drift")
    assert drift.before == {"weights": {"gpu-2": 7}} and balancer.weights["gpu-2"] == 100


class Runtime:
    """HAProxy's runtime API as it holds each backend's servers: what it was asked to add or
    move."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.held = {backend: dict(servers) for backend in ("triton_http", "triton_grpc")}
        self.added: dict[str, str] = {}
        self.moved: list[tuple[str, str, int]] = []
        self.deleted: list[str] = []

    def servers(self, backend: str) -> dict[str, Server]:
        return dict(self.held[backend])

    def weights(self, backend: str) -> dict[str, int]:
        return {name: server.weight for name, server in self.held[backend].items()}

    def add_servers(self, backend: str, servers: dict[str, str]) -> None:
        self.added |= {f"{backend}/{name}": line for name, line in servers.items()}
        self.held[backend] |= {name: Server(0, line.split()[0]) for name, line in servers.items()}

    def move_server(self, backend: str, server: str, address: str, check_port: int) -> None:
        self.moved.append((f"{backend}/{server}", address, check_port))

    def delete_servers(self, backend: str, servers: list[str]) -> None:
        self.deleted += [f"{backend}/{server}" for server in servers]
        self.held[backend] = {n: s for n, s in self.held[backend].items() if n not in servers}

    def set_weights(self, backend: str, weights: dict[str, int]) -> None:
        held = self.held[backend]
        held |= {n: Server(w, held[n].address) for n, w in weights.items()}


def test_haproxy_gets_a_joined_node_as_a_server_a_replaced_pod_moved_a_departed_deleted() -> None:
    pool = NodePool(traffic="haproxy", traffic_backends="triton_http,triton_grpc:grpc")
    proxy = balancing.HAProxy(pool)
    runtime = Runtime({"old": Server(100, "10.0.0.1:8000"), "moved": Server(0, "10.0.0.2:8000")})
    proxy.runtime = runtime  # type: ignore[assignment]
    places = {
        "new": balancing.Place("10.0.0.3:8000", "10.0.0.3:8001"),
        "moved": balancing.Place("10.0.0.9:8000", "10.0.0.9:8001"),
        "named": balancing.Place("triton-7:8000", "triton-7:8001"),
    }
    runtime.held["triton_http"]["left"] = Server(0, "10.0.0.4:8000")
    proxy.sync({"old": 100, "new": 0, "moved": 0, "named": 0}, places, {"left", "never-here"})
    assert runtime.deleted == ["triton_http/left"]
    assert runtime.added["triton_http/new"] == "10.0.0.3:8000 weight 0 check inter 1s fall 2 rise 1"
    assert runtime.added["triton_grpc/new"] == (
        "10.0.0.3:8001 weight 0 proto h2 check check-proto h1 port 8000 inter 1s fall 2 rise 1"
    )
    assert ("triton_http/moved", "10.0.0.9:8000", 0) in runtime.moved
    assert ("triton_grpc/moved", "10.0.0.9:8001", 8000) in runtime.moved
    assert not any(server.endswith("/named") for server, _, _ in runtime.moved)  # a host name


def test_several_nodes_weights_or_errors_are_written_after_locking_them_in_id_order(
    balancer: Balancer,
) -> None:
    """As every locker of several nodes does (`NodeQuerySet.lock`): an UPDATE of several rows
    takes them in the table's scan order, and a reconcile locking some of them in id order
    meanwhile could deadlock with it."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (SQLite locks the whole file)")
    pool = node("gpu-1").pool

    def locks_then_writes(change: Callable[[], object]) -> bool:
        with CaptureQueriesContext(connection) as queries:
            change()
        sqls = [
            q["sql"]
            for q in queries.captured_queries
            if q["sql"].startswith('UPDATE "fleet_node"')
            or ('FROM "fleet_node"' in q["sql"] and "FOR UPDATE" in q["sql"])
        ]
        assert len(sqls) > 1, sqls
        return sqls[0].endswith("ORDER BY 1 ASC FOR UPDATE") and all(
            sql.startswith("UPDATE") for sql in sqls[1:]
        )

    weights = {"gpu-1": 0, "gpu-2": 7, "gpu-3": 7}
    assert locks_then_writes(lambda: balancing.weights_set(pool, weights, "release"))
    expired = timezone.now() - timedelta(seconds=1)
    Node.objects.filter(name__in=["gpu-1", "gpu-2"]).update(draining=True, lease_until=expired)
    assert locks_then_writes(lambda: traffic_sync(pool.pk))  # two drains lapsed, then each node
    balancer.down = True
    assert locks_then_writes(lambda: traffic_sync(pool.pk))
