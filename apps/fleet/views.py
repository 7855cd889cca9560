from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.audit.models import AuditEvent
from apps.fleet.desired import DesiredStateError
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.selectors import (
    failing_operations,
    fleet_summary,
    node_drift,
    node_list,
    node_models,
    pool_views,
)
from apps.fleet.services import FleetError, deployment_remove, deployment_set, operation_request
from apps.registry.models import Model
from controlplane.htmx import HtmxHttpRequest, back

OPEN = [Operation.Status.QUEUED, Operation.Status.RUNNING]


def overview(request: HttpRequest) -> HttpResponse:
    nodes = list(node_list())
    context = {
        "summary": fleet_summary(nodes),
        "nodes": [(node, node_drift(node)) for node in nodes],
        "failing": failing_operations(),
        "events": AuditEvent.objects.all()[:8],
    }
    return render(request, "fleet/overview.html", context)


def serving(request: HttpRequest) -> HttpResponse:
    """Nodes whose index shows `model` at `version` READY (a fragment for other pages)."""
    model, version = request.GET.get("model", ""), request.GET.get("version", "")
    found = [
        node
        for node in node_list()
        if any(e["model"] == model and str(e["version"]) == version for e in node.ready_models)
    ]
    return render(request, "fleet/partials/serving.html", {"nodes": found})


def nodes(request: HtmxHttpRequest) -> HttpResponse:
    """The full page, or for htmx polling just the table (`#node-table`)."""
    template = "fleet/nodes.html#node-table" if request.htmx else "fleet/nodes.html"
    return render(request, template, {"nodes": node_list()})


def node_detail(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The node page; htmx polling gets the live part (`#node-live`), and HTTP 286 stops the
    polling once no operation is open."""
    node = get_object_or_404(Node.objects.select_related("pool"), name=name)
    operations = node.operations.all()[:30]
    context = {
        "node": node,
        "rows": node_models(node),
        "operations": operations,
        "busy": any(op.status in OPEN for op in operations),
        "models": Model.objects.prefetch_related("versions"),
    }
    if request.htmx and request.htmx.target == "node-live":
        response = render(request, "fleet/node_detail.html#node-live", context)
        response.status_code = 200 if context["busy"] else 286
        return response
    return render(request, "fleet/node_detail.html", context)


def _deploy_from_form(
    request: HttpRequest, *, pool: NodePool | None = None, node: Node | None = None
) -> None:
    """Set the deployment chosen in a `model_version` select ("model:version"), with a message."""
    model, _, version = request.POST.get("model_version", "").partition(":")
    where = node.name if node else f"pool {pool.name}"  # type: ignore[union-attr]
    try:
        deployment_set(
            model_name=model,
            version=int(version),
            pool=pool,
            node=node,
            actor=current_user(request),
        )
    except (FleetError, DesiredStateError, ValueError) as exc:
        messages.error(request, f"{where}: {exc}")
    else:
        messages.success(request, f"Loading {model} v{version} on {where}.")


@require_POST
@require("fleet.operate_node", "node.load")
def node_load(request: HttpRequest, name: str) -> HttpResponse:
    """Load a registry version on this node: a node-level deployment that the workers converge."""
    _deploy_from_form(request, node=get_object_or_404(Node, name=name))
    return back(request, reverse("fleet:node_detail", args=[name]))


@require_POST
@require("fleet.operate_node", "node.operate")
def node_operate(request: HttpRequest, name: str) -> HttpResponse:
    node = get_object_or_404(Node, name=name)
    kind, model = request.POST.get("kind", ""), request.POST.get("model", "")
    if kind not in (Operation.Kind.RELOAD, Operation.Kind.UNLOAD):
        messages.error(request, f"unknown action {kind!r}")
        return back(request, reverse("fleet:node_detail", args=[name]))
    try:
        operation_request(node_id=node.pk, kind=kind, model_name=model, actor=current_user(request))
    except (FleetError, DesiredStateError) as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{kind.capitalize()} of {model} on {name} queued.")
    return back(request, reverse("fleet:node_detail", args=[name]))


def deployments(request: HttpRequest) -> HttpResponse:
    context = {"pools": pool_views(), "models": Model.objects.prefetch_related("versions")}
    return render(request, "fleet/deployments.html", context)


@require_POST
@require("fleet.operate_node", "deployment.set")
def deployment_create(request: HttpRequest, pool: str) -> HttpResponse:
    _deploy_from_form(request, pool=get_object_or_404(NodePool, name=pool))
    return back(request, reverse("fleet:deployments"))


@require_POST
@require("fleet.operate_node", "deployment.remove")
def deployment_delete(request: HttpRequest, deployment_id: int) -> HttpResponse:
    found = get_object_or_404(Deployment, pk=deployment_id)
    deployment_remove(deployment_id=found.pk, actor=current_user(request))
    messages.success(request, f"Removed {found}; its models unload from the nodes.")
    return back(request, reverse("fleet:deployments"))
