import dataclasses
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool
from apps.fleet.triton import IndexEntry, ServerMetadata, TritonClient, TritonError


@transaction.atomic
def node_register(
    *, name: str, pool: str, http_url: str, grpc_url: str, metrics_url: str, actor: str
) -> Node:
    """Create or update a node by name; re-registering with the same addresses changes nothing."""
    node_pool, _ = NodePool.objects.get_or_create(name=pool)
    wanted = {"pool": node_pool, "http_url": http_url, "grpc_url": grpc_url}
    wanted["metrics_url"] = metrics_url
    node = Node.objects.select_for_update().filter(name=name).first()
    before = {} if node is None else {k: str(getattr(node, k)) for k in wanted}
    after = {k: str(v) for k, v in wanted.items()}
    if node is None:
        node = Node.objects.create(name=name, **wanted)
    elif before != after:
        for key, value in wanted.items():
            setattr(node, key, value)
        node.save(update_fields=list(wanted))
    if before != after:
        audit_record(
            actor=actor, action="node.register", target=f"node:{name}", before=before, after=after
        )
    return node


def node_poll(*, node_id: int) -> Node:
    """Read the node's health, metadata and repository index; record what was seen."""
    node = Node.objects.get(pk=node_id)
    client = TritonClient(node.http_url, node=node.name)
    try:
        health = client.health()
        metadata = client.server_metadata()
        index = client.repository_index()
    except TritonError as exc:
        return _node_poll_failed(node_id=node_id, error=str(exc))
    return _node_poll_succeeded(
        node_id=node_id, health=health, metadata=metadata, index=index, seen=timezone.now()
    )


@transaction.atomic
def _node_poll_succeeded(
    *, node_id: int, health: str, metadata: ServerMetadata, index: list[IndexEntry], seen: datetime
) -> Node:
    node = Node.objects.select_for_update().get(pk=node_id)
    previous = node.health
    node.health = health
    node.failed_polls = 0
    node.last_seen = seen
    node.last_error = ""
    node.triton_version = metadata.version
    node.extensions = metadata.extensions
    node.index = [dataclasses.asdict(entry) for entry in index]
    node.save()
    if previous == Node.Health.UNREACHABLE:
        audit_record(
            actor="system:poller",
            action="node.up",
            target=f"node:{node.name}",
            before={"health": previous},
            after={"health": health},
        )
    return node


@transaction.atomic
def _node_poll_failed(*, node_id: int, error: str) -> Node:
    node = Node.objects.select_for_update().get(pk=node_id)
    node.failed_polls += 1
    node.last_error = error
    # One missed poll is noise; a few in a row is a node that is down.
    went_down = (
        node.failed_polls >= settings.FLEET_UNREACHABLE_AFTER
        and node.health != Node.Health.UNREACHABLE
    )
    if went_down:
        audit_record(
            actor="system:poller",
            action="node.down",
            target=f"node:{node.name}",
            before={"health": node.health},
            after={"health": Node.Health.UNREACHABLE},
            result="failed",
            message=error,
        )
        node.health = Node.Health.UNREACHABLE
    node.save()
    return node
