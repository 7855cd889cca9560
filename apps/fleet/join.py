"""A node joining its pool, and the one rule of when it takes traffic: found by discovery
(apps/fleet/discovery.py) or back from its departure, it is out of traffic (stage joining,
weight 0) until it answers ready and its index shows its pool's release READY, loaded and warmed
by its run; then it serves. Asked after its run (`joined`) and by each reconcile (`join`)."""

from django.db import transaction
from django.utils import timezone

from apps.fleet.desired import Desired, DesiredStateError, nodes_desired
from apps.fleet.models import Node, Operation
from apps.fleet.polling import stored
from apps.fleet.runner import RECONCILER
from apps.fleet.selectors import converged
from apps.fleet.stages import stage_set
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.triton import TritonClient, TritonError, ready_in

# What decides whether a joining node takes traffic, once its loads ran (its metadata and GPUs
# were polled before its plan).
JOINING_READ = ("health", "index", "last_seen")


def joining_read(node: Node) -> bool:
    """`JOINING_READ` read now onto `node`, not written (its join writes them with its stage);
    False if it did not answer."""
    client = TritonClient.of(node)
    try:
        node.health = client.health()
        node.index = stored(client.repository_index())
    except TritonError:
        return False
    node.last_seen = timezone.now()
    return True


def node_join(node_id: int) -> None:
    """`joined` for a node whose run was not handed its plan (a run_node task), if it joins."""
    if (node := Node.objects.filter(pk=node_id, stage=Node.Stage.JOINING).first()) is not None:
        joined(node)


def joined(node: Node, desired: Desired | None = None) -> None:
    """A joining node whose loads just ran takes traffic now if it may (`join`), rather than at
    its next reconcile; nothing is planned (its run just ended). Only what decides it is read
    again: whether it answers ready, and its index (its metadata and GPUs were polled before
    its plan). `desired`: the state it was planned for, if the caller knows it."""
    if not joining_read(node):
        return  # out of traffic still: the next reconcile polls it in full, and records why
    if desired is None:
        found = nodes_desired([node])[node.pk]
        if isinstance(found, DesiredStateError):
            return
        desired = found
    join(node, desired, read=JOINING_READ)


def join(node: Node, desired: Desired, read: tuple[str, ...] = ()) -> None:
    """A joining node, polled just now, takes traffic once it answers ready and its index shows
    exactly what its desired state names READY (the run that loaded it warmed it, out of
    traffic); until then its balancer weight stays 0. The fields `read` just now, not recorded
    by a poll, are written with its stage."""
    if node.health != Node.Health.READY or node.last_error:
        return
    ready = ready_in(node.index)
    if not all(converged(ready.get(name, ()), model.versions) for name, model in desired.items()):
        return
    now = timezone.now()
    with transaction.atomic():
        locked = Node.objects.select_for_update().select_related("pool").get(pk=node.pk)
        if locked.stage != Node.Stage.JOINING:
            return
        if locked.operations.filter(status__in=Operation.OPEN).exists():
            return
        took = (now - (locked.stage_changed_at or now)).total_seconds()
        serving = {name: sorted(model.versions) for name, model in desired.items()}
        stage_set(
            locked,
            Node.Stage.SERVING,
            actor=RECONCILER,
            action="node.join",
            message=f"takes traffic {took:.1f} s after it joined: its pool's release read "
            "back READY, warmed, ready",
            at=now,
            after={"serving": serving, "joining_s": round(took, 1)},
            fields={field: getattr(node, field) for field in read},
        )
        if locked.pool.traffic:
            transaction.on_commit(lambda: traffic_sync(locked.pool_id), robust=True)
