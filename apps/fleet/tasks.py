"""Thin Celery wrappers: ids in, services do the work. Each task states its delivery policy.

Work on a node goes to its pool's queue, so a pool can be driven by workers next to its nodes
(`celery worker -Q <queue>` in that region); a pool without a queue uses the default one."""

import logging
import random
from collections.abc import Iterable
from typing import Any

from celery import Task, shared_task
from django.conf import settings
from django.utils import timezone

from apps.fleet.discovery import discover
from apps.fleet.models import Heartbeat, Node, NodePool
from apps.fleet.polling import node_poll
from apps.fleet.reconcile import node_reconcile, rollback_windows_close
from apps.fleet.runner import DesiredDigest, NodeBusy, node_run
from apps.fleet.traffic.balancer import PoolAtCapacity, pool_sync
from apps.fleet.triton import TritonUnreachable
from controlplane.prometheus import PrometheusUnavailable

log = logging.getLogger(__name__)


def send_per_node(
    task: Task, node_ids: Iterable[int] | None = None, *, expires: float | None = None
) -> None:
    """One `task` per node (every node when None), each on its pool's queue, expiring after the
    task's own time unless `expires` says otherwise; a node that has departed gets none."""
    nodes = Node.objects.exclude(stage=Node.Stage.DEPARTED)
    nodes = nodes if node_ids is None else nodes.filter(pk__in=node_ids)
    for node_id, queue in nodes.values_list("id", "pool__queue"):
        send_to(queue, task, node_id, expires=expires)


def send_to(queue: str, task: Task, argument: int, *, expires: float | None = None) -> None:
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
    send_per_node(reconcile_node, node_ids, expires=CHANGE_EXPIRES_S)


# A late heartbeat is worthless: one that waited in the queue says nothing about now.
@shared_task(name="fleet.heartbeat", expires=5, soft_time_limit=5, time_limit=10)
def heartbeat() -> None:
    Heartbeat.objects.update_or_create(name="worker", defaults={"at": timezone.now()})


# Periodic and read-mostly: a lost pass is replaced by the next one.
@shared_task(name="fleet.discover", acks_late=True, expires=10, soft_time_limit=30)
def discover_nodes() -> None:
    """The scrape pool's targets read as nodes, when DISCOVERY_SCRAPE_POOL names one; nodes
    that joined (or came back) polled and reconciled at once, not at the next period."""
    if not settings.DISCOVERY_SCRAPE_POOL:
        return
    try:
        found = discover()
    except PrometheusUnavailable as exc:  # nothing departs on a Prometheus that did not answer
        log.warning("discovery: %s", exc)
        return
    send_per_node(poll_node, found.joining)
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
    send_per_node(reconcile_node)
    for pool_id, queue in NodePool.objects.exclude(traffic="").values_list("id", "queue"):
        send_to(queue, sync_traffic, pool_id)


# Like a reconcile: the next period repairs what a lost or failed one left.
@shared_task(name="fleet.sync_traffic", acks_late=True, expires=30, soft_time_limit=20)
def sync_traffic(pool_id: int) -> None:
    pool_sync(pool_id)


# Planning is idempotent (a node with open operations is skipped), so a redelivery is harmless.
# The plan runs in the same task: a release reaches each node without a second trip through a
# queue that holds every other node's reconcile; so does work whose run was lost. Limits as for
# run_node, which it does.
@shared_task(
    name="fleet.reconcile_node", acks_late=True, expires=60, soft_time_limit=300, time_limit=330
)
def reconcile_node(node_id: int) -> None:
    wanted = DesiredDigest()  # what the plan is made from, handed to its run
    if node_reconcile(node_id=node_id, wanted=wanted):
        try:
            node_run(node_id=node_id, wanted=wanted)
        except (NodeBusy, PoolAtCapacity, TritonUnreachable):
            enqueue_run(node_id)  # that task retries with backoff
            return
        # Only a node joining when its plan was made (`wanted`, read under the lock) can join now.
        if wanted.node is None or wanted.node.stage == Node.Stage.JOINING:
            _joined(node_id)


def _joined(node_id: int) -> None:
    """A joining node whose loads just ran is read back at once: converged, it takes traffic
    now rather than at the next period."""
    if Node.objects.filter(pk=node_id, stage=Node.Stage.JOINING).exists():
        node_reconcile(node_id=node_id)


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
    _joined(node_id)


TURN_TRIES = 600  # about half an hour


def enqueue_run(node_id: int) -> None:
    send_per_node(run_node, [node_id])
