from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.degradation.models import Tiers
from apps.degradation.services import TierError, tier_pin, tier_unpin
from apps.fleet.models import Deployment, NodePool
from controlplane.htmx import back

PER_PAGE = 25


def pool_tiers(request: HttpRequest, pool: str) -> HttpResponse:
    """A pool's degradation tiers, model by model: which tier it serves, and why (a pin, the
    automation's last finding, a freeze)."""
    found = get_object_or_404(NodePool, name=pool)
    rows = Tiers.objects.filter(pool=found).select_related("model").order_by("model__name")
    page = Paginator(rows, PER_PAGE).get_page(request.GET.get("page"))
    serving = dict(
        Deployment.objects.filter(pool=found, model__in=[t.model for t in page]).values_list(
            "model__name", "version"
        )
    )
    shown = [(tiers, serving.get(tiers.model.name)) for tiers in page]
    return render(request, "degradation/tiers.html", {"pool": found, "page": page, "rows": shown})


@require_POST
@require("rollouts.rollback_release", "pool.pin_tier")
def pin(request: HttpRequest, pool: str, model: str) -> HttpResponse:
    here = reverse("degradation:tiers", args=[pool])
    try:
        tier, hours = int(request.POST.get("tier", "")), float(request.POST.get("hours", ""))
    except ValueError:
        messages.error(request, "tier and hours: numbers, such as 1 and 4")
        return back(request, here)
    try:
        tiers = tier_pin(
            pool_name=pool,
            model_name=model,
            tier=tier,
            reason=request.POST.get("reason", ""),
            hours=hours,
            actor=current_user(request),
        )
    except TierError as exc:
        messages.error(request, f"{model} on {pool}: {exc}")
    else:
        version = tiers.versions[tiers.pinned or 0]
        messages.success(request, f"{model} on {pool}: pinned to tier {tiers.pinned} (v{version})")
    return back(request, here)


@require_POST
@require("rollouts.rollback_release", "pool.unpin_tier")
def unpin(request: HttpRequest, pool: str, model: str) -> HttpResponse:
    try:
        tier_unpin(pool_name=pool, model_name=model, actor=current_user(request))
    except TierError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{model} on {pool}: unpinned")
    return back(request, reverse("degradation:tiers", args=[pool]))
