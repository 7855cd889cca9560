"""Gray rollouts: start with a plan and analysis, read them with their measurements, act on
them; and on-call's switch of a pool back to its last good release."""

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Router, Schema, Status

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, WAITS, ApiError
from apps.rollouts.models import Rollout
from apps.rollouts.plans import PlanError
from apps.rollouts.proposals import rollout_start
from apps.rollouts.selectors import perf_gate, quality_gate, rollout_rounds, switch_evaluations
from apps.rollouts.services import (
    RolloutError,
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_pause,
    rollout_promote,
    rollout_resume,
    rollout_retry,
)

router = Router(tags=["rollouts"], auth=Token())


class LockstepIn(Schema):
    model: str
    canary_version: int


class LockstepOut(Schema):
    model: str
    baseline: int
    canary: int


class RolloutIn(Schema):
    """`plan`: one step per line (`1 node, hold 60s` / `50%, hold 2m` / `100%`) or the stored
    list form; `analysis`: thresholds, defaults for what is left out, and in `metrics` the
    analysis's own series (answer quality, throughput), each queried once per side and judged
    canary against baseline, such as `{"name": "helpful answers", "higher_is_better": true,
    "tolerance": 0.05, "min": 0.5, "max": 1,
    "query": "avg(rag_helpful_ratio{node=~\\"$nodes\\"})"}`, where
    `$nodes` is a regex of exactly that side's nodes, `$version` its version, with `$pool` and
    `$window`; the canary may be `tolerance` of the baseline's value worse, `min` and `max`
    hold at every step, and no data on a side is inconclusive; their measurements are named
    `custom: <name>`;
    `lockstep`: other models the pool runs, released with this one as one (same canary nodes,
    judged together, promoted or rolled back together);
    `strategy`: `canary`, or `blue_green` for a pipeline release whose changed steps load beside
    the ones serving on every node, are evaluated there by their evaluation sets named
    `analysis.quality_set`, then switch every node at once (its plan is that one step)."""

    model: str
    pool: str
    canary_version: int
    plan: str | list[dict[str, Any]]
    analysis: dict[str, Any] = {}
    accept_shares: bool = False  # a percent step may get more than twice its share (whole nodes)
    template: str = ""  # an analysis template's latest version; `analysis` overrides its fields
    lockstep: list[LockstepIn] = []
    strategy: Literal["canary", "blue_green"] = "canary"


class ReasonIn(Schema):
    reason: str = ""


class MeasurementOut(Schema):
    step: int
    taken_at: datetime
    kind: str  # requests, latency, errors, step, burn, custom, quality or prometheus
    metric: str
    query: str
    canary_value: float | None
    baseline_value: float | None
    threshold: float | None
    verdict: str
    detail: str


class RolloutOut(Schema):
    id: int
    model: str
    pool: str
    baseline_version: int
    canary_version: int
    lockstep: list[LockstepOut]
    strategy: str
    state: str
    step: int
    plan: list[dict[str, Any]]
    analysis: dict[str, Any]
    canary_nodes: list[str]
    last_verdict: str
    reason: str
    started_by: str
    created_at: datetime
    finished_at: datetime | None
    measurements: list[MeasurementOut]


class RoundOut(Schema):
    """One judgement of a step: an analysis during it, the gate before traffic, or the
    evaluation before a blue-green switch."""

    step: int
    number: int
    kind: str
    verdict: str
    taken_at: datetime
    measurements: list[MeasurementOut]


class GateOut(Schema):
    """The gate before traffic: its evaluation run, its scores and verdict once judged, and
    its first failing cases."""

    run: int
    status: str
    score: float | None
    baseline_score: float | None
    passed: int
    failed: int
    verdict: str | None
    failing: list[str]


class PerfPointOut(Schema):
    concurrency: int
    throughput: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    queue_us: float
    compute_us: float


class PerfRunOut(Schema):
    """One of the performance gate's perf_analyzer runs: a version on the drained canary node."""

    id: int
    version: int
    node: str
    status: str
    error: str
    points: list[PerfPointOut]


class PerfGateOut(Schema):
    """The performance gate before traffic: its runs in their order, its verdict once judged."""

    runs: list[PerfRunOut]
    verdict: str | None


class SwitchOut(Schema):
    """A blue-green release's evaluation runs before its switch, one a node and changed step."""

    total: int
    done: int
    passed: int
    verdicts: list[str]


class RolloutDetailOut(RolloutOut):
    """A rollout with its last rounds (`measurements` holds theirs, newest first)."""

    rounds: list[RoundOut]
    gate: GateOut | None
    perf: PerfGateOut | None
    switch: SwitchOut | None


class ReleaseOut(Schema):
    model: str
    pool: str
    version: int


FIELDS = ["id", "baseline_version", "canary_version", "lockstep", "strategy", "state", "step"]
FIELDS += ["plan"]
FIELDS += ["analysis"]
FIELDS += ["canary_nodes", "last_verdict", "reason", "started_by", "created_at", "finished_at"]


ROUNDS = 50  # a rollout's last rounds in its answer


def _rollout_out(rollout: Rollout) -> dict[str, Any]:
    fields = {f: getattr(rollout, f) for f in FIELDS}
    return fields | {"model": rollout.model.name, "pool": rollout.pool.name, "measurements": []}


def _rollout_detail(rollout: Rollout) -> dict[str, Any]:
    """A rollout as its page reads it (apps/rollouts/selectors.py)."""
    rounds = rollout_rounds(rollout, ROUNDS)
    gate, perf, switch = quality_gate(rollout), perf_gate(rollout), switch_evaluations(rollout)
    return _rollout_out(rollout) | {
        "measurements": [m for r in rounds for m in r.measurements.all()],
        "rounds": [
            {
                "step": r.step,
                "number": r.number,
                "kind": r.kind,
                "verdict": r.verdict,
                "taken_at": r.taken_at,
                "measurements": r.measurements.all(),
            }
            for r in rounds
        ],
        "gate": gate
        and {
            "run": gate.run.pk,
            "status": gate.run.status,
            "score": gate.run.score,
            "baseline_score": gate.run.baseline_score,
            "passed": gate.run.passed,
            "failed": gate.run.failed,
            "verdict": gate.measured.verdict if gate.measured else None,
            "failing": [shown.row.case.name for shown in gate.failing],
        },
        "perf": perf
        and {
            "runs": [
                {
                    "id": run.pk,
                    "version": run.version,
                    "node": run.node_name,
                    "status": run.status,
                    "error": run.error,
                    "points": run.points.all(),
                }
                for run in perf.runs
            ],
            "verdict": perf.verdict,
        },
        "switch": switch
        and {
            "total": switch["total"],
            "done": switch["done"],
            "passed": switch["passed"],
            "verdicts": [m.verdict for m in switch["measured"]],
        },
    }


def _found(rollout_id: int) -> Rollout:
    return get_object_or_404(Rollout.objects.select_related("model", "pool"), pk=rollout_id)


def _refused(exc: Exception) -> ApiError:
    if isinstance(exc, PlanError):  # says where: the plan's line, or the analysis field
        return ApiError(422, "invalid_plan", str(exc))
    return ApiError(409, "refused", str(exc))


@router.get("/rollouts", response={200: list[RolloutOut], **ERRORS})
def list_rollouts(
    request: HttpRequest, model: str = "", state: str = "", limit: int = 50
) -> list[dict[str, Any]]:
    found = Rollout.objects.select_related("model", "pool")
    found = found.filter(model__name=model) if model else found
    found = found.filter(state=state) if state else found
    return [_rollout_out(r) for r in found[: max(1, min(limit, 200))]]


@router.get("/rollouts/{rollout_id}", response={200: RolloutDetailOut, **ERRORS})
def get_rollout(request: HttpRequest, rollout_id: int) -> dict[str, Any]:
    return _rollout_detail(_found(rollout_id))


@router.post(
    "/rollouts",
    response={201: RolloutDetailOut, **WAITS, **ERRORS},
    auth=can("rollouts.add_rollout", "rollout.start"),
)
def start_rollout(request: HttpRequest, body: RolloutIn) -> Status[dict[str, Any]]:
    """Start a gray release of `canary_version` on `pool`; poll it until its state is terminal
    (succeeded, rolled_back, failed)."""
    try:
        started = rollout_start(
            model_name=body.model,
            pool_name=body.pool,
            canary_version=body.canary_version,
            plan=body.plan,
            analysis=body.analysis,
            accept_shares=body.accept_shares,
            template=body.template,
            lockstep=[(m.model, m.canary_version) for m in body.lockstep],
            strategy=body.strategy,
            actor=current_user(request),
        )
    except (RolloutError, PlanError) as exc:
        raise _refused(exc) from None
    return Status(201, _rollout_detail(_found(started.pk)))


def _act(
    request: HttpRequest, rollout_id: int, service: Callable[..., Rollout], **extra: str
) -> dict[str, Any]:
    found = _found(rollout_id)
    try:
        acted = service(rollout_id=found.pk, actor=current_user(request), **extra)
    except (RolloutError, PlanError) as exc:
        raise _refused(exc) from None
    return _rollout_detail(_found(acted.pk))


CHANGE = ("rollouts.change_rollout", "rollout.act")


@router.post(
    "/rollouts/{rollout_id}/pause", response={200: RolloutDetailOut, **ERRORS}, auth=can(*CHANGE)
)
def pause_rollout(request: HttpRequest, rollout_id: int) -> dict[str, Any]:
    return _act(request, rollout_id, rollout_pause)


@router.post(
    "/rollouts/{rollout_id}/resume", response={200: RolloutDetailOut, **ERRORS}, auth=can(*CHANGE)
)
def resume_rollout(request: HttpRequest, rollout_id: int) -> dict[str, Any]:
    return _act(request, rollout_id, rollout_resume)


@router.post(
    "/rollouts/{rollout_id}/promote",
    response={200: RolloutDetailOut, **WAITS, **ERRORS},
    auth=can(*CHANGE),
)
def promote_rollout(request: HttpRequest, rollout_id: int, body: ReasonIn) -> dict[str, Any]:
    """Skip the remaining steps and analysis; `reason` is required and recorded."""
    return _act(request, rollout_id, rollout_promote, reason=body.reason)


@router.post(
    "/rollouts/{rollout_id}/abort", response={200: RolloutDetailOut, **ERRORS}, auth=can(*CHANGE)
)
def abort_rollout(request: HttpRequest, rollout_id: int, body: ReasonIn) -> dict[str, Any]:
    return _act(request, rollout_id, rollout_abort, reason=body.reason)


@router.post(
    "/rollouts/{rollout_id}/retry",
    response={200: RolloutDetailOut, **WAITS, **ERRORS},
    auth=can(*CHANGE),
)
def retry_rollout(request: HttpRequest, rollout_id: int) -> dict[str, Any]:
    """A new rollout with the same canary, plan and analysis; the answer is the new one."""
    return _act(request, rollout_id, rollout_retry)


def _switch(request: HttpRequest, pool: str, model: str, service: Any) -> dict[str, Any]:
    try:
        version = service(model_name=model, pool_name=pool, actor=current_user(request))
    except (RolloutError, PlanError) as exc:
        raise _refused(exc) from None
    return {"model": model, "pool": pool, "version": version}


@router.post(
    "/pools/{pool}/models/{model}/rollback",
    response={200: ReleaseOut, **ERRORS},
    auth=can("rollouts.rollback_release", "release.rollback"),
)
def rollback_to_last_good(request: HttpRequest, pool: str, model: str) -> dict[str, Any]:
    """The pool back to its last good release now, aborting a rollout under way."""
    return _switch(request, pool, model, release_rollback)


@router.post(
    "/pools/{pool}/models/{model}/fallback",
    response={200: ReleaseOut, **ERRORS},
    auth=can("rollouts.rollback_release", "release.fallback"),
)
def switch_to_fallback(request: HttpRequest, pool: str, model: str) -> dict[str, Any]:
    """The pool onto the model's registered fallback version now."""
    return _switch(request, pool, model, release_fallback)
