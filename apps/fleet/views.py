from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.html import format_html_join
from django.views.decorators.http import require_POST

from apps.accounts.models import PoolRole
from apps.accounts.permissions import current_user, require
from apps.accounts.services import RoleError
from apps.audit.models import AuditEvent
from apps.fleet.desired import DesiredStateError, Want, Wanted, fleet_desired
from apps.fleet.errors import FleetError
from apps.fleet.memory import capacity, shortfalls
from apps.fleet.models import Deployment, Footprint, Node, NodePool, Operation
from apps.fleet.selectors import (
    NodeFilters,
    failing_operations,
    node_models,
    node_search,
    nodes_read,
    nodes_serving,
    pool_views,
)
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.nodes import (
    node_adopt,
    node_clear,
    operation_override,
    operation_request,
)
from apps.fleet.services.pools import pool_role_set
from apps.registry.models import ModelVersion
from apps.web.htmx import HtmxHttpRequest, back, refused

OVERVIEW_POOLS_PER_PAGE = 50


def overview(request: HttpRequest) -> HttpResponse:
    """The fleet summarised, then per pool a page at a time, each with a drill-down to its
    nodes: 500 pools cost what 50 do."""
    page = Paginator(NodePool.objects.all(), OVERVIEW_POOLS_PER_PAGE)
    pools = page.get_page(request.GET.get("page"))
    fleet = node_search()
    context = {
        "summary": fleet.summary,  # the whole fleet's
        "page": pools,
        "pools": pool_views(pools, fleet=fleet),
        "failing": failing_operations(),
        "events": AuditEvent.objects.all()[:8],
    }
    return render(request, "fleet/overview.html", context)


SERVING_SHOWN = 10


def serving(request: HttpRequest) -> HttpResponse:
    """Nodes whose index shows `model` at `version` READY (a fragment for other pages): counted
    per pool, the first few named."""
    model, version = request.GET.get("model", ""), request.GET.get("version", "")
    number = int(version) if version.isascii() and version.isdecimal() else None
    found = nodes_serving(model, number)
    pools = found.order_by("pool__name").values("pool__name").annotate(nodes=Count("pk"))
    context = {"model": model, "pools": pools, "nodes": found.order_by("name")[:SERVING_SHOWN]}
    return render(request, "fleet/partials/serving.html", context)


def footprints(request: HttpRequest) -> HttpResponse:
    """The memory `model` at `version` was measured to take, per kind of device, and its
    declared estimate (a fragment for the version page)."""
    model, version = request.GET.get("model", ""), request.GET.get("version", "")
    number = int(version) if version.isascii() and version.isdecimal() else 0
    context = {
        "footprints": Footprint.objects.filter(model_name=model, version=number),
        "declared": ModelVersion.objects.filter(model__name=model, version=number)
        .values_list("memory_mb", flat=True)
        .first(),
    }
    return render(request, "fleet/partials/footprints.html", context)


NODES_PER_PAGE = 50


def nodes(request: HtmxHttpRequest) -> HttpResponse:
    """Nodes, filtered and searched on the server, a page at a time; htmx polling gets just the
    summary and the page shown (`#node-table`), never the whole fleet."""
    filters = NodeFilters(
        pool=request.GET.get("pool", ""),
        health=request.GET.get("health", ""),
        stage=request.GET.get("stage", ""),
        model=request.GET.get("model", ""),
        drift=request.GET.get("drift", "") in ("1", "on", "true"),
        search=request.GET.get("q", "").strip(),
    )
    found = node_search(filters)
    page = found.paginator(NODES_PER_PAGE).get_page(request.GET.get("page"))
    page.object_list = found.rows(page.object_list)  # type: ignore[assignment]
    query = urlencode({k: v for k, v in request.GET.items() if k != "page" and v})
    context = {
        "page": page,
        "summary": found.summary,
        "filters": filters,
        "query": query,
        "pools": NodePool.objects.values_list("name", flat=True),
        "healths": Node.Health.choices,
        "stages": Node.Stage.choices,
    }
    template = "fleet/nodes.html#node-table" if request.htmx else "fleet/nodes.html"
    return render(request, template, context)


def node_detail(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The node page; htmx polling gets the live part (`#node-live`), and HTTP 286 stops the
    polling once no operation is open."""
    node = get_object_or_404(Node.objects.select_related("pool"), name=name)
    operations = node.operations.all()[:30]
    desired = fleet_desired(pool_ids=[node.pool_id])  # once, for its rows and their readings
    context = {
        "node": node,
        "rows": node_models(node, desired, nodes_read([node], desired)),
        "operations": operations,
        "busy": any(op.status in Operation.OPEN for op in operations),
        "release_options": _release_options(),
    }
    if request.htmx and request.htmx.target == "node-live":
        response = render(request, "fleet/node_detail.html#node-live", context)
        response.status_code = 200 if context["busy"] else 286
        return response
    return render(request, "fleet/node_detail.html", context)


def _deploy_from_form(
    request: HttpRequest, url: str, *, pool: NodePool | None = None, node: Node | None = None
) -> HttpResponse:
    """Set the deployment chosen in a `model_version` select ("model:version"); a refusal (a
    rollout holding the model, a version not in the registry) is said where the form is."""
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
        return refused(request, f"{where}: {exc}", url)
    messages.success(request, f"Loading {model} v{version} on {where}.")
    return back(request, url)


@require_POST
@require("fleet.operate_node", "deployment.set")
def node_load(request: HttpRequest, name: str) -> HttpResponse:
    """Load a registry version on this node: a node-level deployment that the workers converge."""
    url = reverse("fleet:node_detail", args=[name])
    return _deploy_from_form(request, url, node=get_object_or_404(Node, name=name))


@require_POST
@require("fleet.operate_node", "node.operate")
def node_operate(request: HttpRequest, name: str) -> HttpResponse:
    node = get_object_or_404(Node, name=name)
    kind, model = request.POST.get("kind", ""), request.POST.get("model", "")
    actor = current_user(request)
    here = reverse("fleet:node_detail", args=[name])
    try:
        if kind == "adopt":
            node_adopt(node_id=node.pk, model_name=model, actor=actor)
            done = f"{model} on {name} is managed now: it unloads unless a deployment names it."
        elif kind == "override":
            number = request.POST.get("operation", "")
            operation_override(
                operation_id=int(number) if number.isdecimal() else 0,
                reason=request.POST.get("reason", ""),
                actor=actor,
            )
            done = f"{model} on {name}: sent anyway, as you asked."
        elif kind == "clear":
            node_clear(node_name=name, reason=request.POST.get("reason", ""), actor=actor)
            done = f"{name} is cleared: it serves again once its release reads back READY."
        elif kind in (Operation.Kind.RELOAD, Operation.Kind.UNLOAD):
            operation_request(node_id=node.pk, kind=kind, model_name=model, actor=actor)
            done = f"{kind.capitalize()} of {model} on {name} queued."
        else:
            raise FleetError(f"unknown action {kind!r}")
    except (FleetError, DesiredStateError) as exc:
        return refused(request, str(exc), here)
    messages.success(request, done)
    return back(request, here)


POOLS_PER_PAGE = 10


def _release_options() -> str:
    """The <option>s of a deploy form: every published version, read as two columns (hundreds
    of versions: rows and a template loop cost a page more than its pools do)."""
    published = ModelVersion.objects.filter(status=ModelVersion.Status.PUBLISHED)
    releases = published.order_by("model__name", "version").values_list("model__name", "version")
    option = '<option value="{0}:{1}">{0} v{1}</option>'
    return format_html_join("", option, releases)


def deployments(request: HttpRequest) -> HttpResponse:
    """What every pool should run, a page of pools at a time, each with its nodes summarised."""
    page = Paginator(NodePool.objects.all(), POOLS_PER_PAGE).get_page(request.GET.get("page"))
    # The options are rendered once, not once per pool: hundreds of versions, ten pools.
    context = {
        "page": page,
        "pools": pool_views(page, glance=True),
        "release_options": _release_options(),
    }
    return render(request, "fleet/deployments.html", context)


CAPACITY_PER_PAGE = 50
FIT_SHOWN = 5  # nodes a warning names; it counts the rest


def pool_capacity(request: HttpRequest, pool: str) -> HttpResponse:
    """A pool's memory, node by node, a page at a time: what each has free, what its desired
    state reserves, and whether what it still has to load fits."""
    found = get_object_or_404(NodePool, name=pool)
    # Every node's, for the warning above the table: as many queries for 500 nodes as for 5.
    rows = capacity(list(found.nodes.order_by("name")), fleet_desired(pool_ids=[found.pk]))
    page = Paginator(rows, CAPACITY_PER_PAGE).get_page(request.GET.get("page"))
    short = [row for row in rows if not row.fits]
    context = {
        "pool": found,
        "page": page,
        "rows": page.object_list,
        "short": short[:FIT_SHOWN],
        "more": len(short) - FIT_SHOWN,
        "headroom": f"{settings.FLEET_MEMORY_HEADROOM:.0%}",
        "max_age": f"{settings.FLEET_MEMORY_MAX_AGE_S:g} s",
    }
    return render(request, "fleet/capacity.html", context)


def pool_fit(request: HttpRequest, pool: str) -> HttpResponse:
    """Whether a release chosen in a deploy form ("model:version") would fit on each of the
    pool's memory-aware nodes (or on `node`, for a node's own load form) beside what it serves:
    said before the form is sent."""
    found = get_object_or_404(NodePool, name=pool)
    model, _, version = request.GET.get("model_version", "").partition(":")
    nodes = found.nodes.all()
    if request.GET.get("node"):
        nodes = nodes.filter(name=request.GET["node"])
    short = []
    if version.isdigit():
        change: Wanted = {model: Want(int(version), None, f"{model} v{version}")}
        short = shortfalls(found, list(nodes), change)
    context = {"pool": found, "short": short[:FIT_SHOWN], "more": len(short) - FIT_SHOWN}
    return render(request, "fleet/partials/fit.html", context)


@require_POST
@require("fleet.operate_node", "deployment.set")
def deployment_create(request: HttpRequest, pool: str) -> HttpResponse:
    url = reverse("fleet:deployments")
    return _deploy_from_form(request, url, pool=get_object_or_404(NodePool, name=pool))


@require_POST
@require("fleet.operate_node", "deployment.remove")
def deployment_delete(request: HttpRequest, deployment_id: int) -> HttpResponse:
    found = get_object_or_404(Deployment, pk=deployment_id)
    deployment_remove(deployment_id=found.pk, actor=current_user(request))
    messages.success(request, f"Removed {found}; its models unload from the nodes.")
    return back(request, reverse("fleet:deployments"))


ROLES_PER_PAGE = 50


@require("fleet.change_nodepool", "user.set_pool_role")
def pool_roles(request: HttpRequest) -> HttpResponse:
    """Who holds which role on which pool, above their own role, a page at a time (filtered by
    pool); an admin grants one here, or revokes it (an empty role), audited like the command."""
    here = reverse("fleet:pool_roles")
    if request.method == "POST":
        username, pool, role = (request.POST.get(f, "").strip() for f in ("user", "pool", "role"))
        try:
            pool_role_set(username=username, pool_name=pool, role=role, actor=current_user(request))
        except RoleError as exc:
            return refused(request, str(exc), here, status=422)
        if role:
            messages.success(request, f"{username} is now {role.replace('_', ' ')} of {pool}.")
        else:
            messages.success(request, f"{username} holds no role of their own on {pool} now.")
        return back(request, here)
    pool = request.GET.get("pool", "")
    held = PoolRole.objects.select_related("user", "pool").order_by("pool__name", "user__username")
    context = {
        "page": Paginator(held.filter(pool__name=pool) if pool else held, ROLES_PER_PAGE).get_page(
            request.GET.get("page")
        ),
        "pool": pool,
        "pools": NodePool.objects.order_by("name").values_list("name", flat=True),
        "roles": PoolRole.Role.choices,
        "query": urlencode({"pool": pool}) if pool else "",
    }
    return render(request, "fleet/pool_roles.html", context)
