from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.fleet.models import NodePool
from apps.scaling import selectors
from apps.scaling.services import ScalingError, scaling_pin, scaling_set, targets
from apps.web.htmx import back, refused

FIRST_SHOWN = 10  # nodes a scale-in would take first, named on the page


def pool_scaling(request: HttpRequest, pool: str) -> HttpResponse:
    """The nodes the pool needs and why: each reading's ask, what holds it, a pin; the nodes a
    scale-in would take first. The same reads for a pool of 5 nodes as of 5,000."""
    found = get_object_or_404(NodePool, name=pool)
    shown = selectors.pool_scaling(found)
    context = {
        "pool": found,
        "scaling": shown.scaling,
        "nodes": shown.nodes,
        "serving": shown.serving,
        "first": shown.order[:FIRST_SHOWN],
        "targets": targets(),
    }
    return render(request, "scaling/pool.html", context)


@require_POST
@require("fleet.operate_node", "pool.pin_scaling")
def pin(request: HttpRequest, pool: str) -> HttpResponse:
    here = reverse("scaling:pool", args=[pool])
    text = request.POST.get("nodes", "").strip()
    if text and not text.isdigit():
        return refused(request, f"nodes: a whole number, not {text!r}", here, status=422)
    try:
        scaling_pin(
            pool_name=pool,
            nodes=int(text) if text else None,
            reason=request.POST.get("reason", ""),
            actor=current_user(request),
        )
    except ScalingError as exc:
        return refused(request, f"pool {pool}: {exc}", here)
    messages.success(
        request, f"pool {pool}: pinned at {text} nodes" if text else f"pool {pool}: unpinned"
    )
    return back(request, here)


@require_POST
@require("rollouts.add_rollout", "pool.set_scaling")
def bounds(request: HttpRequest, pool: str) -> HttpResponse:
    here = reverse("scaling:pool", args=[pool])
    least, most = (request.POST.get(name, "").strip() for name in ("least", "most"))
    if not least.isdigit() or (most and not most.isdigit()):
        return refused(
            request, "at least and at most: whole numbers (at most may be empty)", here, status=422
        )
    try:
        scaling_set(
            pool_name=pool,
            least=int(least),
            most=int(most) if most else None,
            actor=current_user(request),
        )
    except ScalingError as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"pool {pool}: {least} to {most or 'any number of'} nodes")
    return back(request, here)
