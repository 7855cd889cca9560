from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.degradation.models import Tiers
from apps.degradation.services import (
    TierError,
    parse_versions,
    tier_confirm,
    tier_pin,
    tier_unpin,
    tiers_set,
)
from apps.fleet.models import Deployment, NodePool
from apps.web.htmx import back, refused

PER_PAGE = 25


def pool_tiers(request: HttpRequest, pool: str) -> HttpResponse:
    """A pool's degradation tiers, model by model: which tier it serves, and why (a pin, the
    automation's last finding, a freeze); which tiers its deployment keeps loaded beside, which
    stands by (its steps loaded: a switch loads only the pipeline's config), and which are cold
    (a switch to one loads it first)."""
    found = get_object_or_404(NodePool, name=pool)
    rows = Tiers.objects.filter(pool=found).select_related("model").order_by("model__name")
    page = Paginator(rows, PER_PAGE).get_page(request.GET.get("page"))
    deployments = Deployment.objects.filter(pool=found, model__in=[t.model for t in page])
    named = {
        name: (version, {version, baseline}, standby)
        for name, version, baseline, standby in deployments.values_list(
            "model__name", "version", "baseline_version", "standby_version"
        )
    }
    shown = [(tiers, *named.get(tiers.model.name, (None, set(), None))) for tiers in page]
    context = {
        "pool": found,
        "page": page,
        "rows": shown,
        "dwell_s": settings.DEGRADATION_DWELL_UP_S,
    }
    return render(request, "degradation/tiers.html", context)


@require_POST
@require("rollouts.rollback_release", "pool.pin_tier")
def pin(request: HttpRequest, pool: str, model: str) -> HttpResponse:
    here = reverse("degradation:tiers", args=[pool])
    try:
        tier, hours = int(request.POST.get("tier", "")), float(request.POST.get("hours", ""))
    except ValueError:
        return refused(request, "tier and hours: numbers, such as 1 and 4", here, status=422)
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
        return refused(request, f"{model} on {pool}: {exc}", here)
    version = tiers.versions[tiers.pinned or 0]
    messages.success(request, f"{model} on {pool}: pinned to tier {tiers.pinned} (v{version})")
    return back(request, here)


@require_POST
@require("rollouts.rollback_release", "pool.unpin_tier")
def unpin(request: HttpRequest, pool: str, model: str) -> HttpResponse:
    here = reverse("degradation:tiers", args=[pool])
    try:
        tier_unpin(pool_name=pool, model_name=model, actor=current_user(request))
    except TierError as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"{model} on {pool}: unpinned")
    return back(request, here)


@require_POST
@require("rollouts.rollback_release", "pool.confirm_restore")
def confirm(request: HttpRequest, pool: str, model: str) -> HttpResponse:
    here = reverse("degradation:tiers", args=[pool])
    try:
        tiers = tier_confirm(pool_name=pool, model_name=model, actor=current_user(request))
    except TierError as exc:
        return refused(request, str(exc), here)
    version = Deployment.objects.get(pool=tiers.pool, model=tiers.model).version
    messages.success(request, f"{model} on {pool}: back up to v{version}")
    return back(request, here)


@require_POST
@require("rollouts.add_rollout", "pool.set_tiers")
def set_tiers(request: HttpRequest, pool: str) -> HttpResponse:
    here = reverse("degradation:tiers", args=[pool])
    model = request.POST.get("model", "").strip()
    try:
        tiers = tiers_set(
            pool_name=pool,
            model_name=model,
            versions=parse_versions(request.POST.get("versions", "")),
            actor=current_user(request),
        )
    except TierError as exc:
        return refused(request, f"{model or 'a model'} on {pool}: {exc}", here)
    listed = " > ".join(f"v{v}" for v in tiers.versions)
    messages.success(request, f"{model} on {pool}: tiers {listed}")
    return back(request, here)
