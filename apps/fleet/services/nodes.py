"""Changes of a node: registering it, its operations, adopting a model, its memory."""

from django.db import transaction

from apps.accounts.permissions import authorize, second_person
from apps.audit.services import Actor, actor_name, audit_record, audited, fields_set
from apps.fleet import addresses, failures, quarantine
from apps.fleet.desired import node_desired
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.tasks import enqueue_run, reconcile_change
from apps.fleet.traffic.haproxy import name_refusal


@audited("node.register", lambda name, **_: f"node:{name}", (FleetError,))
def node_register(
    *, name: str, pool: str, http_url: str, grpc_url: str, metrics_url: str, actor: str
) -> Node:
    """Create or update a node by name; re-registering with the same addresses changes nothing."""
    if refused := name_refusal(name, what="node name"):  # it names the node's balancer server
        raise FleetError(refused)
    for field, url in (("http_url", http_url), ("metrics_url", metrics_url)):
        if url or field == "http_url":
            addresses.validate_url(url, field=field)
    if grpc_url:
        addresses.validate_url(f"grpc://{grpc_url}", field="grpc_url")
    node_pool, _ = NodePool.objects.get_or_create(name=pool)
    wanted = {"pool": node_pool, "http_url": http_url, "grpc_url": grpc_url}
    wanted["metrics_url"] = metrics_url
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None and node.discovered_at is not None:
        # Changed by hand, its addresses would be changed back by the next discovery pass; a
        # departed one rejoins, as itself, when its target is listed again.
        departed = ", departed," if node.stage == Node.Stage.DEPARTED else ""
        raise FleetError(
            f"node {name} is discovered{departed} from Prometheus' targets (at "
            f"{node.metrics_url}): its addresses follow its target; register it under another name"
        )
    before = {} if node is None else {k: str(getattr(node, k)) for k in wanted}
    after = {k: str(v) for k, v in wanted.items()}
    if node is None:
        node = Node.objects.create(name=name, **wanted)
    elif before != after:
        for key, value in wanted.items():
            setattr(node, key, value)
        node.save(update_fields=list(wanted))
    if before != after:
        audit_record(actor=actor, target=f"node:{name}", before=before, after=after)
    return node


def node_target(*, node_id: int, model_name: str, **_: object) -> str:
    name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
    return f"node:{name}:{model_name}"


@audited(lambda kind, **_: f"operation.request_{kind}", node_target, (FleetError,))
def operation_request(*, node_id: int, kind: str, model_name: str, actor: Actor) -> Operation:
    """A person's reload or unload on one node. A second click while one is open returns it."""
    node = Node.objects.select_for_update().select_related("pool").get(pk=node_id)
    authorize(actor, "fleet.operate_node", node.pool)
    open_op = node.operations.filter(
        model_name=model_name,
        kind=kind,
        status__in=Operation.OPEN,
    ).first()
    if open_op is not None:
        return open_op
    desired = node_desired(node).get(model_name)
    if kind == Operation.Kind.UNLOAD and desired is not None:
        raise FleetError(
            f"{model_name} is deployed to {node.name} (pool {node.pool.name}); change or remove "
            "the deployment instead, or the reconciler would load it again"
        )
    if kind == Operation.Kind.UNLOAD and model_name not in node.owned:
        raise FleetError(
            f"{model_name} on {node.name} was loaded by someone else, so the control plane does "
            "not manage it; adopt it first to unload it from here"
        )
    if kind == Operation.Kind.RELOAD and desired is None:
        raise FleetError(f"{model_name} is not deployed to {node.name}; deploy it to load it")
    op = Operation.objects.create(
        node=node,
        kind=kind,
        model_name=model_name,
        versions=list(desired.versions) if desired else [],
        config=desired.config if desired else None,
        config_digest=desired.digest if desired else "",
        requested_by=actor_name(actor),
    )
    audit_record(actor=actor, target=f"node:{node.name}:{model_name}")
    transaction.on_commit(lambda: enqueue_run(node_id), robust=True)
    return op


@audited("operation.override", lambda operation_id, **_: f"operation:{operation_id}", (FleetError,))
def operation_override(*, operation_id: int, reason: str, actor: Actor) -> Operation:
    """Send a load the memory preflight refused, as it was planned, because a person says the
    node has the room (say, a footprint measured while something else loaded)."""
    refused = (
        Operation.objects.select_related("node__pool")
        .filter(pk=operation_id, failure=failures.MEMORY)
        .first()
    )
    if refused is None:
        raise FleetError(f"operation #{operation_id} was not refused for want of memory")
    authorize(actor, "fleet.operate_node", refused.node.pool)
    reason = reason.strip()
    if not reason:
        raise FleetError("an override needs a reason, for the audit trail")
    params = {"operation_id": operation_id, "reason": reason, "node": refused.node.name}
    second_person(actor, refused.node.pool, "operation.override", params)
    op = Operation.objects.create(
        node=refused.node,
        kind=refused.kind,
        model_name=refused.model_name,
        versions=refused.versions,
        config=refused.config,
        config_digest=refused.config_digest,
        requested_by=actor_name(actor),
        override=reason,
    )
    audit_record(
        actor=actor,
        target=f"node:{refused.node.name}:{refused.model_name}",
        after={"refused": operation_id, "operation": op.pk, "versions": op.versions},
        message=reason,
    )
    transaction.on_commit(lambda: enqueue_run(refused.node_id), robust=True)
    return op


@audited("node.adopt", node_target, (FleetError,))
def node_adopt(*, node_id: int, model_name: str, actor: Actor) -> Node:
    """Take over a model someone else loaded on the node: from now on the reconciler manages it,
    so it is unloaded unless a deployment names it."""
    node = Node.objects.select_for_update().select_related("pool").get(pk=node_id)
    authorize(actor, "fleet.operate_node", node.pool)
    # Adopted, a model is unloaded unless a deployment names it: a change to what the pool runs.
    second_person(actor, node.pool, "node.adopt", {"node": node.name, "model": model_name})
    if model_name in node.owned:
        raise FleetError(f"{model_name} on {node.name} is managed already")
    if not any(entry["model"] == model_name for entry in node.index):
        raise FleetError(f"{model_name} is not on {node.name} (by its last repository index)")
    node.owned = sorted({*node.owned, model_name})
    node.save(update_fields=["owned"])
    audit_record(
        actor=actor,
        target=f"node:{node.name}:{model_name}",
        after={"managed": True},
        message="the reconciler unloads it unless a deployment names it",
    )
    return node


@audited("node.set_memory", lambda node_name, **_: f"node:{node_name}", (FleetError,))
def node_set_memory(*, node_name: str, limit_mb: int | None, actor: Actor) -> Node:
    """The memory models may take on the node (None: no limit). Set, every load there is
    checked against it first and its footprint measured (apps/fleet/memory.py)."""
    node = Node.objects.select_for_update().filter(name=node_name).first()
    if node is None:
        raise FleetError(f"no node {node_name!r}")
    if limit_mb is not None and limit_mb < 1:
        raise FleetError(f"node {node_name}: a memory limit of {limit_mb} MiB is not one")
    fields_set(node, {"memory_limit_mb": limit_mb}, actor=actor, target=f"node:{node_name}")
    return node


@audited("node.clear", lambda node_name, **_: f"node:{node_name}", (FleetError,))
def node_clear(*, node_name: str, reason: str, actor: Actor) -> Node:
    """Take a quarantined node back: it joins again, serving once its release reads back READY,
    warmed (say, once its Triton was restarted by hand)."""
    node = Node.objects.select_for_update().select_related("pool").filter(name=node_name).first()
    if node is None:
        raise FleetError(f"no node named {node_name!r}")
    authorize(actor, "fleet.operate_node", node.pool)
    if node.stage != Node.Stage.QUARANTINED:
        raise FleetError(f"{node_name} is {node.stage}, not quarantined")
    if not reason.strip():
        raise FleetError("say why the node may work again: a reason is required")
    quarantine.clear(node, actor=actor, why=reason.strip())
    transaction.on_commit(lambda: reconcile_change([node.pk]), robust=True)
    return node
