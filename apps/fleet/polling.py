"""What the control plane sees of each node: polls of its health, metadata and repository
index, and the up and down events they record (a flapping node folded into one)."""

import dataclasses
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.models import Node
from apps.fleet.node_metrics import parse_gpu_memory, read_metrics
from apps.fleet.triton import (
    IndexEntry,
    ServerMetadata,
    TritonClient,
    TritonError,
)

POLLER = "system:poller"

# What polling writes: never the lease fields, which a worker may be renewing at the same moment.
_OBSERVED = [
    "health",
    "health_changed_at",
    "unrecorded_transitions",
    "failed_polls",
    "last_seen",
    "last_error",
    "triton_version",
    "extensions",
    "index",
    "gpus",
    "gpus_read_at",
]


def node_poll(*, node_id: int) -> Node:
    """Read the node's health, metadata and repository index; record what was seen."""
    return polled(Node.objects.get(pk=node_id))


def polled(node: Node) -> Node:
    """`node_poll` of a node read already; returns it as recorded (read again, locked)."""
    node_id = node.pk
    client = TritonClient.of(node)
    try:
        health = client.health()
        metadata = client.server_metadata()
        index = client.repository_index()
        gpus = (
            parse_gpu_memory(read_metrics(node.metrics_url, node=node.name))
            if node.metrics_url
            else []
        )
    except TritonError as exc:
        return _node_poll_failed(node_id=node_id, error=str(exc))
    return _node_poll_succeeded(
        node_id=node_id,
        health=health,
        metadata=metadata,
        index=index,
        gpus=gpus,
        seen=timezone.now(),
    )


def stored(index: list[IndexEntry]) -> list[dict]:
    """A repository index as a node keeps it (`Node.index`)."""
    return [dataclasses.asdict(entry) for entry in index]


def nodes_read_index(node_ids: list[int]) -> list[Node]:
    """Only the nodes' repository indexes, read now: what a reconcile plans from; in the order
    asked, those removed or departed since left out. Health and metadata are the poller's: one
    HTTP call instead of a poll's four, for a node that serves. One that does not (joining, or
    quarantined) is polled in full: whether it answers ready decides whether it joins, and its
    GPUs how its loads are planned, before any periodic poll has seen it. The nodes read are
    seen now, in one statement; the indexes that changed since the poll are written in another
    (a release's chunk reads nodes that serve what their last poll saw: building one CASE a
    node, bulk_update cost more CPU than running a node's loads)."""
    found = Node.objects.in_bulk(node_ids)
    nodes: list[Node] = []
    read: list[Node] = []
    changed: list[Node] = []
    for node in (found[pk] for pk in node_ids if pk in found):
        if node.stage == Node.Stage.DEPARTED:
            continue  # since the reconcile was sent: no longer polled, nor planned for
        if node.stage in (Node.Stage.JOINING, Node.Stage.QUARANTINED):
            nodes.append(polled(node))
            continue
        try:
            index = TritonClient.of(node).repository_index()
        except TritonError as exc:
            nodes.append(_node_poll_failed(node_id=node.pk, error=str(exc)))
            continue
        if (listed := stored(index)) != node.index:
            node.index = listed
            changed.append(node)
        nodes.append(node)
        read.append(node)
    if read:
        seen = timezone.now()
        for node in read:
            node.last_seen = seen
        with transaction.atomic():  # locked first (Node.objects.lock), then written
            Node.objects.filter(pk__in=[node.pk for node in read]).locked_update(last_seen=seen)
            Node.objects.bulk_update(changed, ["index"])
    return nodes


@transaction.atomic
def _node_poll_succeeded(
    *,
    node_id: int,
    health: str,
    metadata: ServerMetadata,
    index: list[IndexEntry],
    gpus: list[dict],
    seen: datetime,
) -> Node:
    node = Node.objects.select_for_update().get(pk=node_id)
    previous = node.health
    node.health = health
    node.failed_polls = 0
    node.last_seen = seen
    node.last_error = ""
    node.triton_version = metadata.version
    node.extensions = metadata.extensions
    node.index = stored(index)
    node.gpus = gpus
    node.gpus_read_at = seen if gpus else None
    _note_health(node, before=previous, changed=previous == Node.Health.UNREACHABLE, now=seen)
    node.save(update_fields=_OBSERVED)
    return node


@transaction.atomic
def _node_poll_failed(*, node_id: int, error: str) -> Node:
    node = Node.objects.select_for_update().get(pk=node_id)
    node.failed_polls += 1
    node.last_error = error
    # One missed poll is noise; a few in a row is a node that is down.
    previous = node.health
    if node.failed_polls >= settings.FLEET_UNREACHABLE_AFTER:
        node.health = Node.Health.UNREACHABLE
    changed = node.health != previous
    _note_health(node, before=previous, changed=changed, now=timezone.now(), message=error)
    node.save(update_fields=_OBSERVED)
    return node


HEALTH_EVENTS = ("node.up", "node.down")


def _note_health(
    node: Node, *, before: str, changed: bool, now: datetime, message: str = ""
) -> None:
    """Up and down transitions as system events, a flapping node folded so that it cannot flood
    the trail: past FLEET_FLAP_LIMIT recorded transitions within FLEET_FLAP_WINDOW_S, one
    `node.flapping` event, then changes are only counted on the node; once it has held a state
    for FLEET_FLAP_SETTLE_S, one event says where it settled and how many changes it folded."""
    target = f"node:{node.name}"
    if changed:
        node.health_changed_at = now
        recent = AuditEvent.objects.filter(
            target=target,
            action__in=HEALTH_EVENTS,
            created_at__gte=now - timedelta(seconds=settings.FLEET_FLAP_WINDOW_S),
        ).count()
        if node.unrecorded_transitions or recent >= settings.FLEET_FLAP_LIMIT:
            if not node.unrecorded_transitions:
                audit_record(
                    actor=POLLER,
                    action="node.flapping",
                    target=target,
                    before={"health": before},
                    after={"health": node.health},
                    result=AuditEvent.Result.FAILED,
                    message=f"{recent} up/down changes within {settings.FLEET_FLAP_WINDOW_S:g} s; "
                    f"further changes are counted, not recorded, until it holds a state for "
                    f"{settings.FLEET_FLAP_SETTLE_S:g} s",
                )
            node.unrecorded_transitions += 1
            return
    elif not (
        node.unrecorded_transitions
        and node.health_changed_at
        and now - node.health_changed_at >= timedelta(seconds=settings.FLEET_FLAP_SETTLE_S)
    ):
        return
    down = node.health == Node.Health.UNREACHABLE
    folded = node.unrecorded_transitions
    audit_record(
        actor=POLLER,
        action="node.down" if down else "node.up",
        target=target,
        before={"health": before},
        after={"health": node.health} | ({"unrecorded_changes": folded} if folded else {}),
        result=AuditEvent.Result.FAILED if down else AuditEvent.Result.OK,
        message=message or (f"settled after {folded} unrecorded changes" if folded else ""),
    )
    node.unrecorded_transitions = 0
