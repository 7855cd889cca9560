"""A pool's traffic, on pools with a traffic strategy: each node's weight on the balancer in front
of the pool (a rollout's exact shares), kept there by the reconcile, and nodes taken out of
traffic while a worker loads or unloads on them.

The database holds what each node must get (`Node.weight`, `Node.draining`); `traffic_sync`
makes the balancer agree, under the pool's traffic lock, so that a rollout changing weights and a
worker draining a node never interleave their writes. That lock is no row's: a balancer slow to
answer never holds up a person's change of the pool, a rollout or a node; and a rollout's
weights go to the balancer once its transaction has committed, never under its row lock."""

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Protocol
from urllib.parse import urlsplit

from django.db import connection, transaction

from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool
from apps.fleet.traffic.haproxy import HEALTH_CHECKS, HAProxyError, Runtime
from apps.web.clock import database_now

log = logging.getLogger(__name__)
DEFAULT_WEIGHT = 100
MAX_WEIGHT = 256  # HAProxy's
ACTOR = "system:traffic"
TRAFFIC_LOCK = 26_0001  # the advisory lock's first key: the pool's traffic (its second, the pool)


class BalancerError(Exception):
    """The balancer did not take or show the weights; the message says which and why."""


class PoolAtCapacity(Exception):
    """Draining one more node would leave the pool fewer serving nodes than it must keep."""


@dataclass(frozen=True)
class Synced:
    """What the balancer shows once a sync is done, read back."""

    served: dict[str, int]  # by node: its weight now (one that differs, if backends disagree)
    changed: dict[str, int]  # by node: the weight it had, where the sync set another
    problems: dict[str, str]  # by node: why it does not have the weight it must have


@dataclass(frozen=True)
class Place:
    """Where a node answers, for a balancer that adds it as a server (a node that joined on its
    own): the host:port of its HTTP and of its gRPC endpoint ("" when it has none)."""

    http: str
    grpc: str

    @classmethod
    def of(cls, node: Node) -> "Place | None":
        """None for a node a balancer cannot add by itself: one that speaks TLS."""
        url = urlsplit(node.http_url)
        if url.scheme != "http" or not url.hostname:
            return None
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        return cls(http=f"{host}:{url.port or 80}", grpc=node.grpc_url)


class Balancer(Protocol):
    """A traffic strategy: sets the weights of a pool's nodes where they differ from `wanted`
    (adding those it does not know yet at their `places`, removing the `gone`) and reads them
    back; says how many requests a node still answers."""

    def sync(self, wanted: dict[str, int], places: dict[str, Place], gone: set[str]) -> Synced: ...

    def in_flight(self, node: str) -> int: ...


class HAProxy:
    """The pool's nodes are servers, named as the nodes, of each of its HAProxy backends; a node
    that is not one yet (it joined on its own) is added, at its HTTP address, or at its gRPC one
    with HTTP/1.1 health checks on its HTTP port in a backend marked `:grpc`; a node listed at
    a new address (a replaced pod) is moved there; a departed node's server is deleted, so that
    a fleet whose pods come and go does not pile them up."""

    def __init__(self, pool: NodePool) -> None:
        self.runtime = Runtime(pool.traffic_runtime)
        self.backends = pool.backends
        self.grpc = pool.grpc_backends

    def sync(self, wanted: dict[str, int], places: dict[str, Place], gone: set[str]) -> Synced:
        reading = Synced({}, {}, {})
        try:
            for backend in self.backends:
                current = self._placed(backend, wanted, places, gone)
                drifted = {n: w for n, w in wanted.items() if n in current and current[n] != w}
                self.runtime.set_weights(backend, drifted)
                after = self.runtime.weights(backend) if drifted else current
                self._read(backend, wanted, after, reading)
                reading.changed.update({n: current[n] for n in drifted})
        except HAProxyError as exc:
            raise BalancerError(str(exc)) from None
        return reading

    def _placed(
        self, backend: str, wanted: dict[str, int], places: dict[str, Place], gone: set[str]
    ) -> dict[str, int]:
        """The backend's servers' weights, once the nodes it lacks are added, the nodes listed
        elsewhere moved and the departed ones deleted."""
        grpc = backend in self.grpc
        servers = self.runtime.servers(backend)
        if leaving := sorted(gone & set(servers)):
            self.runtime.delete_servers(backend, leaving)
        where = {
            name: place.grpc if grpc else place.http
            for name, place in places.items()
            if name in wanted and (place.grpc or not grpc)
        }
        absent = {
            name: f"{address} weight {wanted[name]} "
            + (f"proto h2 {CHECK_HTTP} {_port(places[name].http)}" if grpc else "check")
            + f" {HEALTH_CHECKS}"
            for name, address in where.items()
            if name not in servers
        }
        moved = {
            name: address
            for name, address in where.items()
            if name in servers
            and servers[name].address != address.replace("[", "").replace("]", "")
            and _literal(address)
        }
        if absent:
            self.runtime.add_servers(backend, absent)
        for name, address in moved.items():
            check = _port(places[name].http) if grpc else 0
            self.runtime.move_server(backend, name, address, check)
        if absent or moved or leaving:
            servers = self.runtime.servers(backend)
        return {name: server.weight for name, server in servers.items()}

    @staticmethod
    def _read(backend: str, wanted: dict[str, int], after: dict[str, int], into: Synced) -> None:
        for node, weight in wanted.items():
            if node not in after:
                into.problems[node] = f"not a server of HAProxy backend {backend}"
            elif after[node] != weight:
                into.problems[node] = f"HAProxy backend {backend} shows weight {after[node]}"
            if node in after and into.served.get(node, weight) == weight:
                into.served[node] = after[node]

    def in_flight(self, node: str) -> int:
        try:
            return self.runtime.in_flight(self.backends, node)
        except HAProxyError as exc:
            raise BalancerError(str(exc)) from None


CHECK_HTTP = "check check-proto h1 port"  # a gRPC server's health, over HTTP/1.1 on this port


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _literal(address: str) -> bool:
    """Whether `address`'s host is an IP address, as HAProxy shows a server's (a host name is
    resolved by HAProxy: never taken for a move)."""
    try:
        ip_address(address.rpartition(":")[0].strip("[]"))
    except ValueError:
        return False
    return True


def balancer(pool: NodePool) -> Balancer | None:
    return HAProxy(pool) if pool.traffic == NodePool.Traffic.HAPROXY else None


def share_weights(percent: int, canary: int, total: int) -> tuple[int, int]:
    """Weights of a canary node and of a baseline node that send exactly `percent` of the
    requests to `canary` nodes of `total` (within HAProxy's range; a ratio that does not fit in
    it is rounded)."""
    if canary >= total or percent >= 100:
        return DEFAULT_WEIGHT, DEFAULT_WEIGHT
    each, rest = percent * (total - canary), (100 - percent) * canary
    common = math.gcd(each, rest)
    each, rest = each // common, rest // common
    scale = DEFAULT_WEIGHT // max(each, rest) or 1  # readable: the larger near 100
    each, rest = each * scale, rest * scale
    if (top := max(each, rest)) > MAX_WEIGHT:
        each, rest = (max(1, round(w * MAX_WEIGHT / top)) for w in (each, rest))
    return each, rest


def weights_set(pool: NodePool, weights: dict[str, int], actor: str) -> None:
    """The pool's nodes get these weights (by name; others keep theirs), on the balancer too once
    the caller's transaction has committed; recorded when they change (a rollout's step, abort
    or end)."""
    if not pool.traffic:
        return
    with transaction.atomic():
        _lock(pool.pk)
        before = dict(pool.nodes.filter(name__in=weights).values_list("name", "weight"))
        changed = {name: w for name, w in weights.items() if before.get(name, w) != w}
        if not changed:
            return
        pool.nodes.filter(name__in=changed).lock()  # in id order, before several rows change
        for weight in set(changed.values()):
            names = [name for name, w in changed.items() if w == weight]
            pool.nodes.filter(name__in=names).update(weight=weight)
        # Robust: a balancer away is recorded on the nodes; the periodic sync tries again.
        transaction.on_commit(lambda: traffic_sync(pool.pk), robust=True)
    audit_record(
        actor=actor,
        action="pool.set_weights",
        target=f"pool:{pool.name}",
        before={"weights": {name: before[name] for name in changed}},
        after={"weights": changed},
    )


def weights_reset(pool: NodePool, actor: str) -> None:
    """Every node of the pool back to an equal share."""
    if pool.traffic:
        names = pool.nodes.values_list("name", flat=True)
        weights_set(pool, dict.fromkeys(names, DEFAULT_WEIGHT), actor)


def _lock(pool_id: int) -> NodePool:
    """The pool's traffic lock, held for the transaction: every change of its nodes' weights or
    drains, and every sync of the balancer, one at a time. On PostgreSQL an advisory lock, not
    the pool's row: what waits on the balancer never holds up a change of the pool itself
    (SQLite has no row locks; its writers take turns anyway)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [TRAFFIC_LOCK, pool_id])
        return NodePool.objects.get(pk=pool_id)
    return NodePool.objects.select_for_update().get(pk=pool_id)


def traffic_sync(pool_id: int) -> dict[str, int]:
    """The balancer made to agree with the pool's nodes, read back; returns what it set back
    that someone else had changed (node -> the weight it had)."""
    with transaction.atomic():
        return _sync(_lock(pool_id))


def _sync(pool: NodePool) -> dict[str, int]:
    """`traffic_sync`, the pool locked. A drain whose worker is gone (no lease on the node) is
    over. A balancer that does not answer is recorded on every node, for their pages, and the
    next sync tries again. Drift is a weight other than the one last read back there: a change
    of ours whose own sync is still to come (it runs once its transaction commits) is none."""
    target = balancer(pool)
    if target is None:
        return {}
    nodes = list(pool.nodes.all())
    at = database_now()  # as leases are judged (apps/web/clock.py)
    lapsed = [n for n in nodes if n.draining and (n.lease_until is None or n.lease_until < at)]
    for node in lapsed:
        node.draining = False
    gone = {node.name for node in nodes if node.stage == Node.Stage.DEPARTED}
    wanted = {node.name: node.wanted_weight for node in nodes if node.name not in gone}
    places = {n.name: p for n in nodes if n.discovered_at and (p := Place.of(n))}
    try:
        # Nothing written yet in this transaction: it holds no row while the balancer answers.
        reading = target.sync(wanted, places, gone)
    except BalancerError as exc:
        pool.nodes.locked_update(traffic_error=str(exc))
        log.warning("pool %s: %s", pool.name, exc)
        return {}
    finally:
        if lapsed:
            ended = Node.objects.filter(pk__in=[n.pk for n in lapsed], draining=True)
            ended.locked_update(draining=False)
    for node in sorted(nodes, key=lambda n: n.pk):  # one row at a time, in id order
        now = (reading.served.get(node.name), reading.problems.get(node.name, ""))
        if (node.served_weight, node.traffic_error) != now:
            Node.objects.filter(pk=node.pk).update(served_weight=now[0], traffic_error=now[1])
    last_read = {node.name: node.served_weight for node in nodes}
    return {name: had for name, had in reading.changed.items() if had != last_read[name]}


def pool_sync(pool_id: int) -> None:
    """The periodic part of the reconcile: weights someone else changed (or an HAProxy that
    restarted with its configured ones) put back, and recorded as drift."""
    changed = traffic_sync(pool_id)
    if changed:
        pool = NodePool.objects.get(pk=pool_id)
        nodes = Node.objects.filter(pool=pool, name__in=changed)
        audit_record(
            actor=ACTOR,
            action="pool.traffic_drift",
            target=f"pool:{pool.name}",
            before={"weights": changed},
            after={"weights": {n.name: n.wanted_weight for n in nodes}},
            message="the balancer's weights differed from the pool's; set them back",
        )


@contextmanager
def drained(node: Node) -> Iterator[bool]:
    """The node out of traffic while the block runs (its in-flight requests finished first),
    then back at its weight. Only while the pool keeps `min_serving` other serving nodes, or
    when the node has no share anyway (a canary being rolled back): raises PoolAtCapacity
    otherwise, before draining anything. On a pool without a traffic strategy, nothing to do.
    Yields whether the node is out of traffic: whether it takes traffic *again* afterwards."""
    pool = node.pool
    target = balancer(pool)
    if target is None:
        yield False
        return
    with transaction.atomic():
        locked = _lock(pool.pk)
        weight, stage = Node.objects.values_list("weight", "stage").get(pk=node.pk)
        serving = pool.nodes.exclude(pk=node.pk).filter(
            health=Node.Health.READY, draining=False, weight__gt=0, stage=Node.Stage.SERVING
        )
        count = serving.count()
        keep = locked.min_serving
        # At weight 0, or joining, it serves nobody already.
        refused = weight and stage == Node.Stage.SERVING and count < keep
        if not refused:
            Node.objects.filter(pk=node.pk).update(draining=True)
    if refused:
        why = f"pool {pool.name} keeps {keep} nodes serving and {count} other"
        why += f"{' does' if count == 1 else 's do'}; the load waits for one to return"
        Node.objects.filter(pk=node.pk).update(traffic_error=why)
        raise PoolAtCapacity(why)
    try:
        traffic_sync(pool.pk)  # committed first: its row is not held while the balancer answers
        _wait_idle(node, pool, target)
        yield True
    finally:
        with transaction.atomic():
            _lock(pool.pk)
            Node.objects.filter(pk=node.pk).update(draining=False)
        traffic_sync(pool.pk)


def _wait_idle(node: Node, pool: NodePool, target: Balancer) -> None:
    """Until the node answers no request, or the pool's drain timeout; either way recorded."""
    deadline = time.monotonic() + pool.drain_timeout_s
    try:
        while (left := target.in_flight(node.name)) and time.monotonic() < deadline:
            time.sleep(0.1)
    except BalancerError as exc:
        left, error = -1, str(exc)
    else:
        error = f"{left} requests still in flight after {pool.drain_timeout_s} s" if left else ""
    audit_record(
        actor=ACTOR,
        action="node.drain",
        target=f"node:{node.name}",
        result="failed" if error else "ok",
        message=error or "out of traffic, no request in flight",
    )
