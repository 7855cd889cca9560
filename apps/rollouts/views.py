from collections.abc import Callable

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment
from apps.observability.charts import Chart, distributions
from apps.rollouts.analysis import Share, observed_share
from apps.rollouts.approvals import APPROVER_PERMISSION, ApprovalError, approval_approve
from apps.rollouts.forms import RolloutForm
from apps.rollouts.models import Approval, Measurement, Rollout
from apps.rollouts.plans import PlanError, parse_plan, preview
from apps.rollouts.services import (
    RolloutError,
    last_good_versions,
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_pause,
    rollout_promote,
    rollout_propose,
    rollout_resume,
    rollout_retry,
    rollout_start,
)
from controlplane.htmx import HtmxHttpRequest, back


def rollout_list(request: HttpRequest) -> HttpResponse:
    """Rollouts, and what each pool runs with the releases on-call can switch it to."""
    rollouts = Paginator(Rollout.objects.select_related("model", "pool"), 25)
    pool_deployments = Deployment.objects.filter(pool__isnull=False).select_related("model", "pool")
    deployments = Paginator(pool_deployments.order_by("pool__name", "model__name"), 25)
    shown = deployments.get_page(request.GET.get("releases"))
    pairs = [(d, (d.model_id, d.pool_id or 0)) for d in shown]
    last_good = last_good_versions([pair for _, pair in pairs])
    context = {
        "rollouts": rollouts.get_page(request.GET.get("page")),
        "deployments": shown,
        "releases": [(d, last_good.get(pair)) for d, pair in pairs],
    }
    return render(request, "rollouts/rollout_list.html", context)


@require("rollouts.add_rollout", "rollout.start")
def rollout_new(request: HttpRequest) -> HttpResponse:
    """The form; "Preview" shows what each step does to which nodes, "Start" starts it."""
    form = RolloutForm(request.POST or None, initial=request.GET.dict())
    context: dict[str, object] = {"form": form}
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        arguments = {
            "model_name": data["model"].name,
            "pool_name": data["pool"].name,
            "canary_version": data["canary_version"],
            "plan": data["plan"],
            "analysis": form.analysis(),
            "accept_shares": data["accept_shares"],
            "template": data["template"],
            "lockstep": data["lockstep"],
        }
        try:
            if "start" in request.POST:
                rollout = rollout_start(**arguments, actor=current_user(request))
                messages.success(request, f"Rollout #{rollout.pk} started.")
                return back(request, reverse("rollouts:rollout_detail", args=[rollout.pk]))
            context["proposal"] = rollout_propose(**arguments)
        except (RolloutError, PlanError) as exc:
            form.add_error("plan" if isinstance(exc, PlanError) else None, str(exc))
    return render(request, "rollouts/rollout_new.html", context)


def rollout_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """The rollout page; htmx polling gets the live part, and HTTP 286 stops it once terminal."""
    found = Rollout.objects.select_related("model", "pool", "template")
    rollout = get_object_or_404(found, pk=pk)
    nodes = list(rollout.pool.nodes.order_by("name").values_list("name", flat=True))
    # Each step with the share it really gets, and the current one's as now observed.
    steps = preview(parse_plan(rollout.plan), nodes, weighted=bool(rollout.pool.traffic))
    context = {
        "rollout": rollout,
        "steps": steps,
        "current_step": steps[min(rollout.step, len(steps) - 1)],
        "observed": _observed(rollout),
        "measurements": rollout.measurements.all()[:60],
        "evidence": evidence_charts(rollout),
        "notifications": rollout.notifications.all()[:20],
        "events": rollout_events(rollout),
    }
    if request.htmx and request.htmx.target == "rollout-live":
        response = render(request, "rollouts/rollout_detail.html#rollout-live", context)
        response.status_code = 200 if rollout.active else 286
        return response
    return render(request, "rollouts/rollout_detail.html", context)


def _observed(rollout: Rollout) -> Share | None:
    """The canary's share of requests, once the current step's canary is READY."""
    if rollout.state != Rollout.State.PROGRESSING or rollout.step_ready_at is None:
        return None
    return observed_share(
        model=rollout.model.name,
        pool=rollout.pool.name,
        canary_nodes=rollout.canary_nodes,
        since_s=(timezone.now() - rollout.step_ready_at).total_seconds(),
    )


def evidence_charts(rollout: Rollout) -> list[tuple[str, Chart]]:
    """The statistical judge's latest samples of each metric, canary against baseline, each
    with its element id."""
    latest: dict[str, Measurement] = {}
    for found in rollout.measurements.exclude(evidence={})[:20]:
        latest.setdefault(found.metric, found)
    charts: list[tuple[str, Chart]] = []
    for found in sorted(latest.values(), key=lambda m: m.metric):
        evidence = found.evidence
        test = "" if evidence["p"] is None else f"U = {evidence['u']:g}, p = {evidence['p']:.3g}, "
        effect = evidence["effect"]
        size = "" if effect is None else f"effect {effect:+.3g}, "
        note = f"{test}{size}step {found.step + 1} at {found.taken_at:%H:%M:%S} UTC"
        sides = {"canary": evidence["canary"], "baseline": evidence["baseline"]}
        unit = "ms" if "latency" in found.metric else "ratio"
        chart = distributions(f"{found.metric}: {found.verdict}", sides, unit=unit, note=note)
        charts.append((f"evidence-{len(charts)}", chart))
    return charts


def rollout_events(rollout: Rollout) -> list[AuditEvent]:
    return list(
        AuditEvent.objects.filter(target__startswith=f"rollout:{rollout.pk}:").order_by(
            "created_at", "id"
        )
    )


ACTIONS: dict[str, Callable[..., Rollout]] = {
    "pause": rollout_pause,
    "resume": rollout_resume,
    "abort": rollout_abort,
    "retry": rollout_retry,
}


@require_POST
@require("rollouts.change_rollout", "rollout.act")
def rollout_act(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    actor = current_user(request)
    target = pk
    try:
        if action == "promote":
            rollout_promote(rollout_id=pk, reason=request.POST.get("reason", ""), actor=actor)
        elif action in ACTIONS:
            result = ACTIONS[action](rollout_id=pk, actor=actor)
            target = result.pk
        else:
            raise RolloutError(f"unknown action {action!r}")
    except RolloutError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Rollout #{target}: {action} done.")
    return back(request, reverse("rollouts:rollout_detail", args=[target]))


@require_POST
@require("rollouts.rollback_release", "release.switch")
def release_switch(request: HttpRequest, pool: str, model: str, to: str) -> HttpResponse:
    """One click for on-call: the pool to its last good release, or to the model's fallback."""
    service = {"last-good": release_rollback, "fallback": release_fallback}.get(to)
    try:
        if service is None:
            raise RolloutError(f"unknown target {to!r}")
        version = service(model_name=model, pool_name=pool, actor=current_user(request))
    except RolloutError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Pool {pool} is switching {model} to v{version}.")
    following = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(following, allowed_hosts={request.get_host()}):
        following = reverse("fleet:deployments")
    return back(request, following)


def approvals(request: HttpRequest) -> HttpResponse:
    """Changes to protected pools waiting for a second person, then the ones decided."""
    found = Approval.objects.select_related("pool", "requested_by", "approved_by")
    page = Paginator(found, 25).get_page(request.GET.get("page"))
    context = {"page": page, "now": timezone.now(), "user_id": current_user(request).pk}
    return render(request, "rollouts/approvals.html", context)


@require_POST
@require(APPROVER_PERMISSION, "approval.approve")
def approval_approve_view(request: HttpRequest, pk: int) -> HttpResponse:
    try:
        approval = approval_approve(approval_id=pk, actor=current_user(request))
    except ApprovalError as exc:
        messages.error(request, str(exc))
    else:
        done = f"Approved #{pk}: {approval.action} on {approval.pool.name} is {approval.status}"
        (messages.success if not approval.result else messages.error)(
            request, done + (f": {approval.result}" if approval.result else ".")
        )
    return back(request, reverse("rollouts:approvals"))
