"""Thin Celery wrappers: ids in, services do the work. Each task states its delivery policy.

Work on a node goes to its pool's queue, so a pool can be driven by workers next to its nodes
(`celery worker -Q <queue>` in that region); a pool without a queue uses the default one."""

import logging
import random
import time
from collections import defaultdict
from collections.abc import Iterable
from contextvars import copy_context
from typing import Any

from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import OperationalError
from django.utils import timezone

from apps.audit.context import REQUEST_ID
from apps.fleet.discovery import discover
from apps.fleet.join import joined, node_join
from apps.fleet.models import Heartbeat, Node, NodePool
from apps.fleet.polling import node_poll
from apps.fleet.reconcile import Planned, nodes_reconcile, rollback_windows_close
from apps.fleet.runner import NodeBusy, node_run
from apps.fleet.traffic.balancer import PoolAtCapacity, pool_sync
from apps.fleet.triton import TritonUnreachable
from apps.prometheus.client import PrometheusUnavailable

log = logging.getLogger(__name__)


def _listed(node_ids: Iterable[int] | None) -> list[tuple[int, str]]:
    """(id, queue) of these nodes (every node when None), less those that departed."""
    nodes = Node.objects.exclude(stage=Node.Stage.DEPARTED)
    nodes = nodes if node_ids is None else nodes.filter(pk__in=node_ids)
    return list(nodes.order_by("pool_id", "id").values_list("id", "pool__queue"))


def send_per_node(
    task: Task, node_ids: Iterable[int] | None = None, *, expires: float | None = None
) -> None:
    """One `task` per node (every node when None), each on its pool's queue, expiring after the
    task's own time unless `expires` says otherwise; a node that has departed gets none."""
    for node_id, queue in _listed(node_ids):
        send_to(queue, task, node_id, expires=expires)


# A queue's nodes go to `task` in chunks of CHUNK_NODES at most, and into SPREAD tasks at least
# where it has that many nodes: a Celery task, and a chunk's plan, cost their worker more CPU
# than a node's reconcile does, and at 5,000 nodes a task a node is most of a release's work; a
# small change's nodes each get a task still, taken by as many workers in parallel. A pool's
# change of 100 nodes goes in 8 chunks of 12 (in 33 of 3 while SPREAD was 32: 6 ms of a node's
# CPU more, tests/bench/test_reconcile_scale.py's gauge).
CHUNK_NODES = 20
SPREAD = 8


def chunked(ids: list[int]) -> list[list[int]]:
    """A queue's nodes, in the chunks `send_chunked` sends them in."""
    size = max(1, min(CHUNK_NODES, len(ids) // SPREAD))
    return [ids[start : start + size] for start in range(0, len(ids), size)]


def send_chunked(
    task: Task, node_ids: Iterable[int] | None = None, *, expires: float | None = None
) -> None:
    """`task(ids)` for chunks of these nodes (every node when None) that share a queue, on it;
    a node that has departed is in none."""
    queues: dict[str, list[int]] = defaultdict(list)
    for node_id, queue in _listed(node_ids):
        queues[queue].append(node_id)
    for queue, ids in queues.items():
        for chunk in chunked(ids):
            send_to(queue, task, chunk, expires=expires)


def send_to(queue: str, task: Task, argument: object, *, expires: float | None = None) -> None:
    """`task(argument)` on `queue`, or on the default queue when empty."""
    options: dict[str, Any] = {"queue": queue} if queue else {}
    if expires:
        options["expires"] = expires
    task.apply_async((argument,), **options)


# A change's reconcile (a release, a node that joined or was released) must reach every node
# however long the queue ahead of it: a release to 5,000 nodes queues minutes of work at once.
# The periodic reconcile's expire sooner: the next period replaces them.
CHANGE_EXPIRES_S = 1800.0


def reconcile_change(node_ids: Iterable[int]) -> None:
    """Reconcile these nodes now: what they should run, or where they are, has changed."""
    send_chunked(reconcile_nodes, node_ids, expires=CHANGE_EXPIRES_S)


# A late heartbeat is worthless: one that waited in the queue says nothing about now.
@shared_task(name="fleet.heartbeat", expires=5, soft_time_limit=5, time_limit=10)
def heartbeat() -> None:
    Heartbeat.objects.update_or_create(name="worker", defaults={"at": timezone.now()})


# Periodic and read-mostly: a lost pass is replaced by the next one.
@shared_task(name="fleet.discover", acks_late=True, expires=10, soft_time_limit=30)
def discover_nodes() -> None:
    """The scrape pool's targets read as nodes, when DISCOVERY_SCRAPE_POOL names one; nodes
    that joined (or came back) reconciled at once, not at the next period (its reconcile polls
    a joining node in full: its health and GPUs are known before anything is planned)."""
    if not settings.DISCOVERY_SCRAPE_POOL:
        return
    try:
        found = discover()
    except PrometheusUnavailable as exc:  # nothing departs on a Prometheus that did not answer
        log.warning("discovery: %s", exc)
        return
    reconcile_change(found.joining)


@shared_task(name="fleet.poll_nodes", acks_late=True, expires=10)
def poll_nodes() -> None:
    """Fan out one poll per node, so one slow node never delays the others."""
    send_per_node(poll_node)


# Polling is read-only and periodic: a lost or failed poll is simply replaced by the next one,
# so no retries here.
@shared_task(name="fleet.poll_node", acks_late=True, expires=10, soft_time_limit=20, time_limit=30)
def poll_node(node_id: int) -> None:
    node_poll(node_id=node_id)


@shared_task(name="fleet.reconcile_all", acks_late=True, expires=30)
def reconcile_all() -> None:
    """Level-triggered: every node, every period; a lost message is healed by the next one.
    Pools with a traffic strategy get their balancer's weights checked, once per pool; rollback
    windows that have passed close first."""
    rollback_windows_close()
    send_chunked(reconcile_nodes)
    for pool_id, queue in NodePool.objects.exclude(traffic="").values_list("id", "queue"):
        send_to(queue, sync_traffic, pool_id)


# Like a reconcile: the next period repairs what a lost or failed one left.
@shared_task(name="fleet.sync_traffic", acks_late=True, expires=30, soft_time_limit=20)
def sync_traffic(pool_id: int) -> None:
    pool_sync(pool_id)


# Planning is idempotent (a node with open operations is skipped), so a redelivery is harmless.
# A chunk's nodes are planned together (one transaction: a statement for all where each node
# had its own), then run one after another in the same task: a release reaches each node
# without a second trip through a queue that holds every other node's reconcile; so does work
# whose run was lost. Runs go on for CHUNK_BUDGET_S (then one node) at most: the rest of the
# chunk's runs go to run_node, a task a node, so nodes whose loads take minutes never keep other
# chunks waiting long. Limits: the budget, then one node's run as for run_node. A plan the
# database refused (a deadlock, a lost connection) is tried again shortly: acked, the chunk
# would wait for the next periodic pass, and a change sent by hand would wait for none.
CHUNK_BUDGET_S = 60


@shared_task(
    name="fleet.reconcile_nodes",
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=1,
    retry_jitter=True,
    max_retries=3,
    expires=60,
    soft_time_limit=CHUNK_BUDGET_S + 300,
    time_limit=CHUNK_BUDGET_S + 330,
)
def reconcile_nodes(node_ids: list[int]) -> None:
    ends = time.monotonic() + CHUNK_BUDGET_S
    planned = list(nodes_reconcile(node_ids).items())
    for done, (node_id, plan) in enumerate(planned, 1):
        try:
            # A context of its own: the request a node's plan is recorded under ends with it.
            copy_context().run(_run, node_id, plan)
        except SoftTimeLimitExceeded:
            raise
        except Exception:  # one node's trouble is its own: the chunk's other nodes go on
            log.exception("node %s: run failed", node_id)
        if time.monotonic() > ends and (rest := planned[done:]):
            send_per_node(run_node, [node_id for node_id, _ in rest])
            return


def _run(node_id: int, planned: Planned) -> None:
    """Run what the node's reconcile planned; a node busy or away retries its run."""
    if planned.request:
        REQUEST_ID.set(planned.request)
    try:
        node_run(node_id=node_id, wanted=planned.wanted)
    except (NodeBusy, PoolAtCapacity, TritonUnreachable):
        enqueue_run(node_id)  # that task retries with backoff
        return
    # Only a node joining when its plan was made (read under the lock), and since, joins now.
    if (node := planned.wanted.node) is not None and node.stage == Node.Stage.JOINING:
        joined(node, planned.desired)


# Retries only when the node did not answer or another worker holds it; a config Triton refuses
# fails its operation instead. A node its pool cannot spare from traffic yet waits its turn,
# looked at every few seconds, for as long as a pool-wide release may take. Loads take minutes
# at most: soft 300 s < hard 330 s < the broker's 600 s visibility timeout.
@shared_task(
    bind=True,
    name="fleet.run_node",
    acks_late=True,
    autoretry_for=(TritonUnreachable, NodeBusy),
    retry_backoff=2,
    retry_backoff_max=60,
    retry_jitter=True,
    max_retries=8,
    soft_time_limit=300,
    time_limit=330,
)
def run_node(self: Task, node_id: int) -> None:
    try:
        node_run(node_id=node_id)
    except PoolAtCapacity as exc:
        raise self.retry(exc=exc, countdown=random.uniform(2, 4), max_retries=TURN_TRIES) from None
    node_join(node_id)


TURN_TRIES = 600  # about half an hour


def enqueue_run(node_id: int) -> None:
    send_per_node(run_node, [node_id])
