"""Nodes whose load hung. Triton's loads can stay LOADING until the server restarts
(server#8766); such a node takes no traffic and gets no further work until a person clears it
(`services.nodes.node_clear`) or it shows the load no longer LOADING (a restart), and then it
joins again: loaded, read back and warmed before it serves."""

import math

from django.conf import settings
from django.db import transaction

from apps.audit.services import Actor
from apps.fleet import failures
from apps.fleet.models import Node, Operation
from apps.fleet.stages import stage_set
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.triton import TritonClient, TritonError

ACTOR = "system:reconciler"


def stuck(client: TritonClient, op: Operation) -> str:
    """Why `op`, a load Triton did not answer in time, is stuck, or "" when it is not (or the
    node cannot say): its versions still LOADING in the index, and not ready when asked of the
    model itself (an index can lag behind the model)."""
    try:
        loading = sorted(
            e.version
            for e in client.repository_index()
            if e.version is not None
            and (e.model, e.state) == (op.model_name, "LOADING")
            and e.version in op.versions
        )
        hung = [v for v in loading if not client.version_ready(op.model_name, v)]
    except TritonError:
        return ""
    if not hung:
        return ""
    listed = ", ".join(f"v{v}" for v in hung)
    return (
        f"{op.model_name} {listed} still LOADING {settings.FLEET_LOAD_TIMEOUT_S:g} s after its "
        "load was sent, and not ready: a hung load"
    )


def quarantine(node: Node, why: str) -> str:
    """Out of traffic and left alone, with `why` on its page, in the trail and in /metrics;
    returns what its hung load is failed with. Past FLEET_QUARANTINE_MAX_SHARE of its pool, a
    load that hangs everywhere would take the pool out of traffic node by node: the node stays
    as it is instead, serving what it served, and the change goes no further there."""
    with transaction.atomic():
        locked = Node.objects.select_for_update().select_related("pool").get(pk=node.pk)
        pool = Node.objects.filter(pool_id=locked.pool_id).exclude(stage=Node.Stage.DEPARTED)
        held = pool.filter(stage=Node.Stage.QUARANTINED).exclude(pk=node.pk).count()
        most = max(1, math.floor(settings.FLEET_QUARANTINE_MAX_SHARE * pool.count()))
        if held + 1 > most:
            return (
                f"{why}, on {held + 1} nodes of pool {locked.pool.name} now: more than {most} "
                "quarantined would take the pool out of traffic, so this node keeps serving "
                "what it served and the change stops here"
            )
        why += "; the node is quarantined until a person or a restart clears it"
        stage_set(
            locked,
            Node.Stage.QUARANTINED,
            actor=ACTOR,
            action="node.quarantine",
            message=why,
            reason=why,
            result="failed",
        )
        node.stage, node.stage_reason = locked.stage, locked.stage_reason  # a run's node too
        if locked.pool.traffic:
            transaction.on_commit(lambda: traffic_sync(locked.pool_id), robust=True)
    return why


def clear(node: Node, *, actor: Actor, why: str) -> None:
    """Back to joining: it serves again once its release reads back READY, warmed; the hung
    load may be tried again now. Call under the node's row lock."""
    hung = node.stage_reason
    stage_set(
        node,
        Node.Stage.JOINING,
        actor=actor,
        action="node.clear",
        message=why,
        before={"reason": hung},
    )
    node.operations.filter(failure=failures.STUCK, retry_at__isnull=True).update(
        retry_at=node.stage_changed_at
    )


def restarted(node: Node) -> bool:
    """Whether the node's index, just read, no longer shows its hung load LOADING (Triton was
    restarted, or the load ended after all): then it is cleared, to join again."""
    hung = (
        node.operations.filter(failure=failures.STUCK)
        .order_by("-id")
        .values_list("model_name", "versions")
        .first()
    )
    model, versions = hung or ("", [])
    if any(
        e["model"] == model and e.get("state") == "LOADING" and e.get("version") in versions
        for e in node.index
    ):
        return False
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if locked.stage != Node.Stage.QUARANTINED:
            return False
        clear(locked, actor=ACTOR, why=f"{model} is no longer LOADING there: restarted")
    return True
