from celery import shared_task

from apps.fleet.models import Node
from apps.fleet.services import node_poll


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
