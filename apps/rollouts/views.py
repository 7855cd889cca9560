from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme, urlencode
from django.views.decorators.http import require_POST

from apps.accounts.permissions import authorize_audited, current_user, require
from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, NodePool
from apps.observability.bottleneck import BottleneckUnread, bottleneck_in
from apps.observability.charts import Chart, curves, distributions
from apps.performance.models import PerfSearch
from apps.registry.models import Model
from apps.rollouts.forms import DEFAULT_PLAN, RolloutForm
from apps.rollouts.models import Rollout
from apps.rollouts.plans import PlanError, parse_plan, preview
from apps.rollouts.proposals import RolloutError, rollout_propose, rollout_start
from apps.rollouts.results import Kind
from apps.rollouts.selectors import (
    PerfGate,
    canary_share,
    judge_evidence,
    last_good_versions,
    perf_gate,
    quality_gate,
    rollout_events,
    rollout_rounds,
    switch_evaluations,
)
from apps.rollouts.services import (
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_pause,
    rollout_promote,
    rollout_resume,
    rollout_retry,
)
from apps.rollouts.tuning import search_advice, tuning_start
from apps.web.htmx import HtmxHttpRequest, back, refused


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
def rollout_new(request: HtmxHttpRequest) -> HttpResponse:
    """The form; "Preview" shows what each step does to which nodes, "Start" starts it. A
    model chosen (htmx) gets its published versions and evaluation sets."""
    form = RolloutForm(request.POST or None, initial=request.GET.dict())
    context: dict[str, object] = {"form": form}
    if request.htmx and request.htmx.target == "canary-field":
        # The evaluation set's field sits elsewhere in the form: it is swapped out of band.
        parts = [("canary-field", False), ("quality-set-field", True)]
        return HttpResponse(
            "".join(
                render_to_string(
                    f"rollouts/rollout_new.html#{part}", context | {"oob": oob}, request
                )
                for part, oob in parts
            )
        )
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
            "strategy": data["strategy"],
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
    found = Rollout.objects.select_related(
        "model",
        "pool",
        "template",
        "gate_run__evaluation_set",
        "gate_run__node",
        "gate_run__baseline_node",
    )
    rollout = get_object_or_404(found, pk=pk)
    nodes = list(rollout.pool.nodes.serving().order_by("name").values_list("name", flat=True))
    # Each step with the share it really gets, and the current one's as now observed.
    steps = preview(parse_plan(rollout.plan), nodes, weighted=bool(rollout.pool.traffic))
    events = rollout_events(rollout)
    now = timezone.now()
    perf = perf_gate(rollout)
    context = {
        "rollout": rollout,
        "steps": steps,
        "current_step": steps[min(rollout.step, len(steps) - 1)],
        "observed": canary_share(rollout),
        "measurements": [m for r in rollout_rounds(rollout, ROUNDS) for m in r.measurements.all()],
        "evidence": evidence_charts(rollout),
        "notifications": rollout.notifications.all()[:20],
        "events": events,
        "tuning": tuning(rollout, events, now),
        "gate": quality_gate(rollout),
        "perf": perf,
        "perf_chart": perf_chart(rollout, perf) if perf and perf.runs else None,
        "switch": switch_evaluations(rollout),
        "chart_query": chart_query(rollout, now),
    }
    if request.htmx and request.htmx.target == "rollout-live":
        response = render(request, "rollouts/rollout_detail.html#rollout-live", context)
        response.status_code = 200 if rollout.active else 286
        return response
    return render(request, "rollouts/rollout_detail.html", context)


ROUNDS = 20  # the rollout's last rounds on its page, with their measurements
# The charts start before the rollout began, to show the baseline it was judged against: half
# its age, a minute at least and five at most; they end a minute after it finished.
LEAD_MIN, LEAD_MAX, AFTER = timedelta(minutes=1), timedelta(minutes=5), timedelta(minutes=1)
MAX_SPAN = timedelta(days=30)  # what a chart's custom range allows (apps/observability/views.py)


def chart_query(
    rollout: Rollout, now: datetime, *, metric: str = "p99_nodes", model: str = ""
) -> str:
    """A chart's query (`rollout`'s model by default): from shortly before the rollout began to
    now, or to shortly after it finished, so that a young rollout is not squeezed into the last
    pixels of a fixed range."""
    end = min(now, rollout.finished_at + AFTER) if rollout.finished_at else now
    age = min(now, rollout.finished_at or now) - rollout.created_at
    lead = min(LEAD_MAX, max(LEAD_MIN, age / 2))
    start = max(rollout.created_at - lead, end - MAX_SPAN)
    return urlencode(
        {
            "metric": metric,
            "model": model or rollout.model.name,
            "pool": rollout.pool.name,
            "range": "custom",
            "start": f"{start.astimezone(UTC):%Y-%m-%dT%H:%M:%S}",
            "end": f"{end.astimezone(UTC):%Y-%m-%dT%H:%M:%S}",
        }
    )


UNITS: dict[str, str] = {
    Kind.LATENCY: "ms",
    Kind.TTFT: "ms",
    Kind.ITL: "ms",
    Kind.TOKENS: "tokens",
}


def evidence_charts(rollout: Rollout) -> list[tuple[str, Chart]]:
    """The statistical judge's latest samples of each metric as charts, each with its element
    id."""
    charts: list[tuple[str, Chart]] = []
    for found in judge_evidence(rollout):
        evidence = found.evidence
        test = "" if evidence["p"] is None else f"U = {evidence['u']:g}, p = {evidence['p']:.3g}, "
        effect = evidence["effect"]
        size = "" if effect is None else f"effect {effect:+.3g}, "
        note = f"{test}{size}step {found.step + 1} at {found.taken_at:%H:%M:%S} UTC"
        sides = {"canary": evidence["canary"], "baseline": evidence["baseline"]}
        unit = UNITS.get(found.kind, "ratio")
        chart = distributions(f"{found.metric}: {found.verdict}", sides, unit=unit, note=note)
        charts.append((f"evidence-{len(charts)}", chart))
    return charts


def perf_chart(rollout: Rollout, gate: PerfGate) -> Chart:
    """The performance gate's runs as latency-throughput curves, canary against baseline."""
    lines = {
        f"{'canary' if run.version == rollout.canary_version else 'baseline'} v{run.version}, "
        f"run #{run.pk}": [(p.throughput, p.p99_ms, f"c{p.concurrency}") for p in run.points.all()]
        for run in gate.runs
    }
    note = "Each point a concurrency (c): requests a second served, and their P99."
    return curves(
        "P99 against throughput, before traffic", lines, x="requests/s", y="ms", note=note
    )


def tuning(rollout: Rollout, events: list[AuditEvent], now: datetime) -> dict[str, Any] | None:
    """What a tuning release changed and why (its `rollout.tune` event), with the query of its
    step's cost chart over the rollout."""
    found = next((e.after for e in events if e.action == "rollout.tune"), None)
    if found is None:
        return None
    return found | {"cost_query": chart_query(rollout, now, metric="cost", model=found["step"])}


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
        return refused(request, str(exc), reverse("rollouts:rollout_detail", args=[target]))
    messages.success(request, f"Rollout #{target}: {action} done.")
    return back(request, reverse("rollouts:rollout_detail", args=[target]))


@require_POST
@require("rollouts.rollback_release", "release.rollback")
def release_roll_back(request: HttpRequest, pool: str, model: str, to: str) -> HttpResponse:
    """One click for on-call: the pool to its last good release, or to the model's fallback."""
    service = {"last-good": release_rollback, "fallback": release_fallback}.get(to)
    following = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(following, allowed_hosts={request.get_host()}):
        following = reverse("fleet:deployments")
    try:
        if service is None:
            raise RolloutError(f"unknown target {to!r}")
        version = service(model_name=model, pool_name=pool, actor=current_user(request))
    except RolloutError as exc:
        return refused(request, str(exc), following)
    messages.success(request, f"Pool {pool} is switching {model} to v{version}.")
    return back(request, following)


@require_POST
@require("rollouts.add_rollout", "rollout.tune")
def tune(request: HttpRequest, name: str) -> HttpResponse:
    """An advice accepted: read afresh (the page may be old), it becomes a tuning release, a
    rollout of a new pipeline version (apps/rollouts/tuning.py)."""
    ensemble = get_object_or_404(Model, name=name, kind=Model.Kind.ENSEMBLE)
    pool = request.POST.get("pool", "")
    here = reverse("observability:bottleneck", args=[name]) + "?" + urlencode({"pool": pool})
    step, change = request.POST.get("step", ""), request.POST.get("change", "")
    actor = current_user(request)
    where = NodePool.objects.filter(name=pool).first()
    if where is None:
        return refused(request, f"no pool {pool!r}", here, status=404)
    # Before Prometheus is asked anything on this person's behalf.
    authorize_audited(actor, "rollouts.add_rollout", where, "rollout.tune")
    try:
        _, found = bottleneck_in(ensemble, pool)
        advice = next((a for a in found.advice if (a.step, a.change) == (step, change)), None)
        if advice is None:
            raise RolloutError(
                f"the advice {change!r} for {step} no longer holds: the page shows what does now"
            )
        rollout = tuning_start(
            pipeline=name,
            pool_name=pool,
            advice=advice,
            plan=request.POST.get("plan") or DEFAULT_PLAN,
            template=request.POST.get("template", ""),
            actor=actor,
        )
    except (BottleneckUnread, RolloutError, PlanError) as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"Rollout #{rollout.pk}: {advice.change} for {step}, as a release.")
    return back(request, reverse("rollouts:rollout_detail", args=[rollout.pk]))


@require_POST
@require("rollouts.add_rollout", "rollout.tune")
def search_release(request: HttpRequest, pk: int) -> HttpResponse:
    """A search's winner released as a tuning rollout, as an accepted advice is."""
    here = reverse("performance:search_detail", args=[pk])
    pool_name = get_object_or_404(PerfSearch, pk=pk).pool_name
    where = NodePool.objects.filter(name=pool_name).first()
    authorize_audited(current_user(request), "rollouts.add_rollout", where, "rollout.tune")
    try:
        search, advice = search_advice(pk)
        rollout = tuning_start(
            pipeline=search.pipeline.name,
            pool_name=search.pool_name,
            advice=advice,
            plan=request.POST.get("plan") or DEFAULT_PLAN,
            template=request.POST.get("template", ""),
            actor=current_user(request),
        )
    except (RolloutError, PlanError) as exc:
        return refused(request, str(exc), here)
    messages.success(request, f"Rollout #{rollout.pk}: {advice.change} for {advice.step}.")
    return back(request, reverse("rollouts:rollout_detail", args=[rollout.pk]))
