"""Nodes and what they serve, deployments (desired state), operations, and a pool's traffic as
a Kubernetes Gateway API HTTPRoute."""

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from ninja import Query, Router, Schema, Status
from pydantic import AfterValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from apps.accounts.models import PoolRole
from apps.accounts.permissions import current_user
from apps.accounts.services import RoleError
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, WAITS, ApiError
from apps.api.paging import Limit, Offset
from apps.fleet.desired import DesiredStateError, FleetDesired, fleet_desired
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.selectors import (
    Reading,
    Readings,
    converged,
    drift_of,
    node_models,
    nodes_read,
    observed_many,
)
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.nodes import operation_request
from apps.fleet.services.pools import pool_role_set, pool_set_discoverable
from apps.fleet.traffic.gateway import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    LABEL,
    SUBDOMAIN,
    GatewayError,
    httproute,
)

router = Router(tags=["fleet"], auth=Token())


class ModelState(Schema):
    model: str
    desired: list[int]
    ready: list[int]
    managed: bool
    drift: bool


class NodeOut(Schema):
    name: str
    pool: str
    health: str
    http_url: str
    triton_version: str
    last_seen: datetime | None
    last_error: str
    models: list[ModelState]
    drift: list[str]


class DeploymentIn(Schema):
    """`model` at `version` on a `pool` (every node) or on one `node`: exactly one of the two."""

    model: str
    version: int
    pool: str | None = None
    node: str | None = None


class NodeProgress(Schema):
    node: str
    health: str
    ready: list[int]
    converged: bool


class DeploymentOut(Schema):
    id: int
    model: str
    version: int
    baseline_version: int | None
    target: str
    created_by: str
    updated_at: datetime
    nodes: list[NodeProgress]
    converged: bool


class OperationIn(Schema):
    kind: Literal["reload", "unload"]
    model: str


class OperationOut(Schema):
    id: int
    node: str
    kind: str
    model: str
    versions: list[int]
    status: str
    error: str
    requested_by: str
    created_at: datetime
    finished_at: datetime | None


def _node_out(node: Node, desired: FleetDesired, readings: Readings) -> dict[str, Any]:
    rows = node_models(node, desired, readings)
    return {
        **{f: getattr(node, f) for f in ("name", "health", "http_url", "triton_version")},
        **{f: getattr(node, f) for f in ("last_seen", "last_error")},
        "pool": node.pool.name,
        "models": [
            {
                "model": r.model,
                "desired": r.desired,
                "ready": r.ready,
                "managed": r.managed,
                "drift": r.drift,
            }
            for r in rows
        ],
        "drift": drift_of(rows),
    }


def _nodes_of(deployment: Deployment) -> list[Node]:
    if deployment.node:
        return [deployment.node]
    # A departed node is the pool's no longer: a deployment converges without it (the pool's
    # nodes are prefetched: read here, not queried again).
    nodes: list[Node] = list(deployment.pool.nodes.all())  # type: ignore[union-attr,misc]
    return [n for n in nodes if n.stage != Node.Stage.DEPARTED]


def _deployments_out(deployments: list[Deployment]) -> list[dict[str, Any]]:
    nodes = {node.pk: node for d in deployments for node in _nodes_of(d)}
    readings = observed_many(list(nodes.values()), {d.model.name for d in deployments})
    desired = fleet_desired(pool_ids={node.pool_id for node in nodes.values()})
    return [_deployment_out(d, readings, desired) for d in deployments]


def _wanted(desired: FleetDesired, node: Node, model: str) -> tuple[int, ...] | None:
    """The versions of `model` the node's desired state names; None when it cannot be resolved."""
    try:
        found = desired.of(node).get(model)
    except DesiredStateError:
        return None
    return found.versions if found else None


def _deployment_out(
    deployment: Deployment, readings: dict[tuple[int, str], Reading], desired: FleetDesired
) -> dict[str, Any]:
    """Desired state and, node by node, whether the node has converged on the model."""
    name = deployment.model.name
    progress = []
    for node in _nodes_of(deployment):
        ready, _ = readings[(node.pk, name)]
        progress.append(
            {
                "node": node.name,
                "health": node.health,
                "ready": sorted(ready),
                "converged": converged(ready, _wanted(desired, node, name)),
            }
        )
    return {
        **{f: getattr(deployment, f) for f in ("id", "version", "baseline_version")},
        **{f: getattr(deployment, f) for f in ("created_by", "updated_at")},
        "model": deployment.model.name,
        "target": deployment.target,
        "nodes": progress,
        "converged": all(p["converged"] for p in progress),
    }


def _operation_out(op: Operation) -> dict[str, Any]:
    return {
        **{f: getattr(op, f) for f in ("id", "kind", "versions", "status", "error")},
        **{f: getattr(op, f) for f in ("requested_by", "created_at", "finished_at")},
        "node": op.node.name,
        "model": op.model_name,
    }


def _kubernetes_name(rule: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not rule.fullmatch(value):
            raise PydanticCustomError("kubernetes_name", f"not a Kubernetes name ({what})")
        return value

    return AfterValidator(check)


# Checked by a validator rather than a `pattern` constraint, whose error quotes the regular
# expression; the schema still shows clients the pattern.
GatewayName = Annotated[
    str,
    _kubernetes_name(
        DNS_SUBDOMAIN,
        "RFC 1123 subdomain: at most 253 lowercase letters, digits, '-' and '.', "
        "starting and ending with a letter or digit",
    ),
    WithJsonSchema({"type": "string", "pattern": f"^{SUBDOMAIN}$", "maxLength": 253}),
]
NamespaceName = Annotated[
    str,
    _kubernetes_name(
        DNS_LABEL,
        "RFC 1123 label: at most 63 lowercase letters, digits and '-', "
        "starting and ending with a letter or digit",
    ),
    WithJsonSchema({"type": "string", "pattern": f"^{LABEL}$", "maxLength": 63}),
]
GATEWAY = Query(
    "triton",
    max_length=253,
    description="the Gateway the route attaches to, in the route's namespace",
)
NAMESPACE = Query(
    "default",
    max_length=63,
    description="the route's namespace, where the nodes' Services are",
)
PORT = Query(8000, ge=1, le=65535, description="Triton's HTTP port on each node's Service")
YAML = "application/yaml; charset=utf-8"
# What the YAML holds, for the schema: clients (and Schemathesis) parse it and check the shape.
HTTPROUTE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object", "required": ["name", "namespace", "labels"]},
        "spec": {"type": "object", "required": ["parentRefs", "rules"]},
    },
}


def _deployments() -> Any:
    return Deployment.objects.select_related("model", "pool", "node").prefetch_related(
        "pool__nodes"
    )


@router.get("/nodes", response={200: list[NodeOut], **ERRORS})
def list_nodes(
    request: HttpRequest, pool: str = "", offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """Nodes by name, `limit` from `offset`."""
    found = Node.objects.select_related("pool").order_by("name")
    nodes = list((found.filter(pool__name=pool) if pool else found)[offset : offset + limit])
    desired = fleet_desired(pool_ids={n.pool_id for n in nodes})
    readings = nodes_read(nodes, desired)
    return [_node_out(n, desired, readings) for n in nodes]


@router.get("/nodes/{name}", response={200: NodeOut, **ERRORS})
def get_node(request: HttpRequest, name: str) -> dict[str, Any]:
    node = get_object_or_404(Node.objects.select_related("pool"), name=name)
    desired = fleet_desired(pool_ids=[node.pool_id])
    return _node_out(node, desired, nodes_read([node], desired))


@router.get("/deployments", response={200: list[DeploymentOut], **ERRORS})
def list_deployments(
    request: HttpRequest, offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """Deployments, `limit` from `offset`, each with its nodes' progress."""
    return _deployments_out(list(_deployments().order_by("id")[offset : offset + limit]))


@router.get("/deployments/{deployment_id}", response={200: DeploymentOut, **ERRORS})
def get_deployment(request: HttpRequest, deployment_id: int) -> dict[str, Any]:
    return _deployments_out([get_object_or_404(_deployments(), pk=deployment_id)])[0]


@router.post(
    "/deployments",
    response={201: DeploymentOut, **WAITS, **ERRORS},
    auth=can("fleet.operate_node", "deployment.set"),
)
def create_deployment(request: HttpRequest, body: DeploymentIn) -> Status[dict[str, Any]]:
    """Desire a published version on a pool or a node; the reconciler loads it. Poll the
    deployment until `converged`: nodes' indexes read back, never assumed."""
    if (body.pool is None) == (body.node is None):
        raise ApiError(422, "invalid_request", "name a pool or a node: exactly one of the two")
    pool = get_object_or_404(NodePool, name=body.pool) if body.pool else None
    node = get_object_or_404(Node, name=body.node) if body.node else None
    try:
        made = deployment_set(
            model_name=body.model,
            version=body.version,
            pool=pool,
            node=node,
            actor=current_user(request),
        )
    except FleetError as exc:
        raise ApiError(409, "refused", str(exc)) from None
    return Status(201, _deployments_out([get_object_or_404(_deployments(), pk=made.pk)])[0])


@router.delete(
    "/deployments/{deployment_id}",
    response={204: None, **WAITS, **ERRORS},
    auth=can("fleet.operate_node", "deployment.remove"),
)
def remove_deployment(request: HttpRequest, deployment_id: int) -> Status[None]:
    found = get_object_or_404(Deployment, pk=deployment_id)
    deployment_remove(deployment_id=found.pk, actor=current_user(request))
    return Status(204, None)


@router.get("/operations", response={200: list[OperationOut], **ERRORS})
def list_operations(
    request: HttpRequest, node: str = "", status: str = "", limit: int = Limit
) -> list[dict[str, Any]]:
    found = Operation.objects.select_related("node").order_by("-created_at")
    found = found.filter(node__name=node) if node else found
    found = found.filter(status=status) if status else found
    return [_operation_out(op) for op in found[:limit]]


@router.post(
    "/nodes/{name}/operations",
    response={202: OperationOut, **ERRORS},
    auth=can("fleet.operate_node", "node.operate"),
)
def request_operation(request: HttpRequest, name: str, body: OperationIn) -> Status[dict[str, Any]]:
    """A reload or unload on one node, queued; poll /operations for its outcome."""
    found = get_object_or_404(Node, name=name)
    try:
        op = operation_request(
            node_id=found.pk, kind=body.kind, model_name=body.model, actor=current_user(request)
        )
    except (FleetError, DesiredStateError) as exc:
        raise ApiError(409, "refused", str(exc)) from None
    return Status(202, _operation_out(op))


class DiscoverableIn(Schema):
    discoverable: bool


class DiscoverableOut(Schema):
    pool: str
    discoverable: bool


@router.post(
    "/pools/{pool}/discoverable",
    response={200: DiscoverableOut, **WAITS, **ERRORS},
    auth=can("rollouts.add_rollout", "pool.set_discoverable"),
)
def set_discoverable(request: HttpRequest, pool: str, body: DiscoverableIn) -> dict[str, Any]:
    """Open the pool to discovery (its labelled targets join by themselves), or close it; on a
    protected pool, opening it waits for a second person (202)."""
    found = get_object_or_404(NodePool, name=pool)
    pool_set_discoverable(
        pool_name=found.name, discoverable=body.discoverable, actor=current_user(request)
    )
    return {"pool": found.name, "discoverable": body.discoverable}


class PoolRoleIn(Schema):
    """`operator` or `release_manager` on the pool, above the user's own role; "" takes it back."""

    role: str


class PoolRoleOut(Schema):
    user: str
    pool: str
    role: str


ADMIN = "fleet.change_nodepool"  # as the pool roles page: an admin's


@router.get(
    "/pool-roles",
    response={200: list[PoolRoleOut], **ERRORS},
    auth=Token(ADMIN),
)
def list_pool_roles(
    request: HttpRequest, pool: str = "", offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """Who holds which role on which pool (by pool, then user), `limit` from `offset`."""
    held = PoolRole.objects.order_by("pool__name", "user__username")
    rows = (held.filter(pool__name=pool) if pool else held)[offset : offset + limit]
    return [
        {"user": user, "pool": name, "role": role}
        for user, name, role in rows.values_list("user__username", "pool__name", "role")
    ]


@router.put(
    "/pools/{pool}/roles/{username}",
    response={200: PoolRoleOut, **ERRORS},
    auth=can(ADMIN, "user.set_pool_role"),
)
def set_pool_role(
    request: HttpRequest, pool: str, username: str, body: PoolRoleIn
) -> dict[str, Any]:
    """Give the user a role on the pool, or take theirs back (an empty role), audited as the
    pool roles page and `manage.py set_pool_role` do."""
    try:
        pool_role_set(
            username=username, pool_name=pool, role=body.role, actor=current_user(request)
        )
    except RoleError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    return {"user": username, "pool": pool, "role": body.role}


@router.get(
    "/pools/{name}/httproute",
    response={200: None, **ERRORS},
    openapi_extra={
        "responses": {
            200: {
                "description": "The pool's HTTPRoute, as YAML",
                "content": {"application/yaml": {"schema": HTTPROUTE}},
            }
        }
    },
)
def get_httproute(
    request: HttpRequest,
    name: str,
    gateway: GatewayName = GATEWAY,
    namespace: NamespaceName = NAMESPACE,
    port: int = PORT,
) -> HttpResponse:
    """The pool's traffic as a Kubernetes Gateway API HTTPRoute: each node's Service (one per
    node, named as the node) at the node's weight, 0 while it is drained."""
    pool = get_object_or_404(NodePool, name=name)
    nodes = list(pool.nodes.order_by("name"))
    try:
        text = httproute(pool, nodes, gateway=gateway, namespace=namespace, port=port)
    except GatewayError as exc:
        raise ApiError(409, "refused", str(exc)) from None
    return HttpResponse(text, content_type=YAML)
