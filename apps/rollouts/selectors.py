"""Reads of the rollouts app that more than one caller needs: the rollout page and the API read
a rollout's rounds, its gate, its switch and the judge's evidence through the same functions."""

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, F, Prefetch, Q
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.fleet.models import Deployment, NodePool, Release
from apps.performance.models import PerfRun
from apps.quality.models import EvaluationRun
from apps.quality.selectors import Shown, run_rows, shown_rows
from apps.registry.models import Model
from apps.rollouts.analysis import Share, observed_share
from apps.rollouts.models import AnalysisTemplate, Measurement, Rollout, Round
from apps.rollouts.plans import Analysis

State = Rollout.State


def template_names() -> list[str]:
    """Every analysis template's name, once, in order."""
    names = AnalysisTemplate.objects.order_by("name").values_list("name", flat=True)
    return list(names.distinct())


def last_good_version(model: Model, pool: NodePool) -> int | None:
    """The newest version the pool ran before its current one; never a canary that was rolled
    back or failed, nor a release on-call rolled back from."""
    return last_good_versions([(model.pk, pool.pk)]).get((model.pk, pool.pk))


def last_good_versions(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """`last_good_version` of each (model id, pool id) pair, in three queries however many."""
    models, pools = {m for m, _ in pairs}, {p for _, p in pairs}
    current = dict(
        ((d.model_id, d.pool_id), d.version)
        for d in Deployment.objects.filter(model_id__in=models, pool_id__in=pools)
    )
    bad: dict[tuple[int, int], set[int]] = {}
    failed = Rollout.objects.filter(
        model_id__in=models, pool_id__in=pools, state__in=[State.ROLLED_BACK, State.FAILED]
    )
    for model_id, pool_id, version in failed.values_list("model_id", "pool_id", "canary_version"):
        bad.setdefault((model_id, pool_id), set()).add(version)
    releases = list(
        Release.objects.filter(model_id__in=models, pool_id__in=pools)
        .order_by("-started_at", "-id")
        .values_list("model_id", "pool_id", "version", "rolled_back")
    )
    for model_id, pool_id, version, rolled_back in releases:
        if rolled_back:
            bad.setdefault((model_id, pool_id), set()).add(version)
    found: dict[tuple[int, int], int] = {}
    for model_id, pool_id, version, _ in releases:
        pair = (model_id, pool_id)
        if pair in found or version in bad.get(pair, ()) or version == current.get(pair):
            continue
        found[pair] = version
    return {pair: found[pair] for pair in pairs if pair in found}


def rollout_rounds(rollout: Rollout, limit: int) -> list[Round]:
    """The rollout's last `limit` rounds, newest first, each with its measurements (newest
    first too): two queries."""
    measurements = Prefetch("measurements", Measurement.objects.order_by("-taken_at", "-id"))
    return list(rollout.rounds.prefetch_related(measurements)[:limit])


GATE_CASES = 10  # failing cases named with a gate; its run's page has every one


@dataclass(frozen=True)
class Gate:
    """The gate before traffic: its run, what it was judged against, its round's measurement
    once judged and, once finished, its first failing cases."""

    run: EvaluationRun
    spec: Analysis
    measured: Measurement | None
    failing: list[Shown]  # with their inputs and the checks that judged them


def quality_gate(rollout: Rollout) -> Gate | None:
    run = rollout.gate_run
    if run is None:
        return None
    measured = next(
        (
            m
            for m in rollout.measurements.filter(round__kind=Round.Kind.GATE)[:5]
            if m.evidence.get("run") == run.pk
        ),
        None,
    )
    failing = run_rows(run, only="failing", limit=GATE_CASES) if run.finished else []
    shown = shown_rows(failing, judged_only=True)
    return Gate(run, Analysis.from_dict(rollout.analysis), measured, shown)


@dataclass(frozen=True)
class PerfGate:
    spec: Analysis
    runs: list[PerfRun]  # in their order (canary, baseline, baseline, canary), with their points
    measured: list[Measurement]  # the verdict's, at each concurrency, once judged
    verdict: str | None  # the round's: its measurements' worst


def perf_gate(rollout: Rollout) -> PerfGate | None:
    """The performance gate's runs so far and its last verdict; none without a gate."""
    spec = Analysis.from_dict(rollout.analysis)
    if not spec.perf_concurrency:
        return None
    runs = rollout.perf_runs.select_related("model").prefetch_related("points").order_by("id")
    last = rollout.rounds.filter(kind=Round.Kind.PERF).first()
    measured = list(last.measurements.order_by("id")) if last else []
    return PerfGate(spec, list(runs), measured, last.verdict if last else None)


SWITCH_RUNS = 20  # nodes' evaluation runs listed with a blue-green switch, worst first


def switch_evaluations(rollout: Rollout) -> dict[str, Any] | None:
    """A blue-green release's evaluation runs before its switch, worst first, and how many
    have finished and passed: a bounded read, however many nodes."""
    if rollout.strategy != Rollout.Strategy.BLUE_GREEN:
        return None
    runs = rollout.gate_runs.select_related("evaluation_set__model", "node")
    spec = Analysis.from_dict(rollout.analysis)
    counts = runs.aggregate(
        total=Count("id"),
        done=Count("id", filter=Q(finished_at__isnull=False)),
        passed=Count("id", filter=Q(score__gte=spec.quality_min_score)),
    )
    return {
        "runs": runs.order_by(F("score").asc(nulls_first=True), "node__name")[:SWITCH_RUNS],
        "spec": spec,
        "measured": rollout.measurements.filter(round__kind=Round.Kind.SWITCH),
        **counts,
    }


def judge_evidence(rollout: Rollout) -> list[Measurement]:
    """The statistical judge's latest samples of each metric, canary against baseline, by name."""
    latest: dict[str, Measurement] = {}
    for found in rollout.measurements.exclude(evidence={})[:20]:
        if {"canary", "baseline", "p"} <= found.evidence.keys():  # not an evaluation's run
            latest.setdefault(found.metric, found)
    return sorted(latest.values(), key=lambda m: m.metric)


def canary_share(rollout: Rollout) -> Share | None:
    """The canary's share of requests, once the current step's canary is READY."""
    if rollout.state != Rollout.State.PROGRESSING or rollout.step_ready_at is None:
        return None
    return observed_share(
        model=rollout.model.name,
        pool=rollout.pool.name,
        canary_nodes=rollout.canary_nodes,
        since_s=(timezone.now() - rollout.step_ready_at).total_seconds(),
    )


def rollout_events(rollout: Rollout) -> list[AuditEvent]:
    """What happened to the rollout, oldest first: its trail's events."""
    return list(
        AuditEvent.objects.filter(target__startswith=f"rollout:{rollout.pk}:").order_by(
            "created_at", "id"
        )
    )
