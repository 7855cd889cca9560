"""Thin Celery wrappers: ids in, services do the work. Each task states its delivery policy."""

from celery import shared_task

from apps.fleet.models import Node
from apps.fleet.operations import NodeBusy, node_reconcile, node_run
from apps.fleet.services import node_poll
from apps.fleet.triton import TritonUnreachable


@shared_task(name="fleet.poll_nodes", acks_late=True, expires=10)
def poll_nodes() -> None:
    """Fan out one poll per node, so one slow node never delays the others."""
    for node_id in Node.objects.values_list("id", flat=True):
        poll_node.delay(node_id)


# Polling is read-only and periodic: a lost or failed poll is simply replaced by the next one,
# so no retries here.
@shared_task(name="fleet.poll_node", acks_late=True, expires=10, soft_time_limit=20, time_limit=30)
def poll_node(node_id: int) -> None:
    node_poll(node_id=node_id)


@shared_task(name="fleet.reconcile_all", acks_late=True, expires=30)
def reconcile_all() -> None:
    """Level-triggered: every node, every period; a lost message is healed by the next one."""
    for node_id in Node.objects.values_list("id", flat=True):
        reconcile_node.delay(node_id)


# Planning is idempotent (a node with open operations is skipped), so a redelivery is harmless.
@shared_task(
    name="fleet.reconcile_node", acks_late=True, expires=60, soft_time_limit=30, time_limit=45
)
def reconcile_node(node_id: int) -> None:
    node_reconcile(node_id=node_id)


# Retries only when the node did not answer or another worker holds it; a config Triton refuses
# fails its operation instead. Loads take minutes at most: soft 300 s < hard 330 s < the broker's
# 600 s visibility timeout.
@shared_task(
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
def run_node(node_id: int) -> None:
    node_run(node_id=node_id)
