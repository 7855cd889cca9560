"""What a rollout learns of its canary's answers, and the evidence it makes: the quality gate's
and the steps' evaluation runs and their verdicts, and synthetic requests where a side of the
comparison has too few of its own. The controller decides what to do with them."""

import logging
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol

from django.utils import timezone

from apps.fleet.models import Node
from apps.quality.errors import QualityError
from apps.quality.models import EvaluationRun, EvaluationSet, SyntheticLoad
from apps.quality.selectors import failing_cases
from apps.quality.services import evaluation_start, synthetic_load_start
from apps.quality.tasks import RUN_TIME_LIMIT_S
from apps.registry.models import Model
from apps.rollouts.analysis import ChangedStep, Result
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Analysis
from apps.rollouts.verdicts import Verdict

log = logging.getLogger(__name__)
ACTOR = "system:rollouts"  # the controller's name in the trail, and its gates'


class Release(Protocol):
    """The model a rollout releases: its canary, its baseline, and whether that is kept beside."""

    @property
    def canary(self) -> int: ...

    @property
    def baseline(self) -> int: ...

    @property
    def beside(self) -> int | None: ...


def pinned_set(rollout: Rollout, model: str) -> EvaluationSet | None:
    """The evaluation set the rollout's gates run for `model`: the version pinned when it
    started (what an approval showed), never one imported since."""
    pk = rollout.quality_sets.get(model)
    return EvaluationSet.objects.filter(pk=pk).first() if pk else None


def evaluate(
    rollout: Rollout,
    spec: Analysis,
    *,
    lead: Release,
    canary: list[Node],
    nodes: list[Node],
    when: str,
) -> EvaluationRun:
    """Queue the rollout's evaluation set against the canary, on a canary node, and against the
    baseline where a node serves it. Raises QualityError."""
    found = pinned_set(rollout, rollout.model.name)
    if found is None:
        raise QualityError(
            f"{rollout.model.name} has no evaluation set {spec.quality_set!r}; import one"
        )
    others = [n for n in nodes if n not in canary]
    # The baseline is asked on a node still serving it. Beside the canary only for a plain
    # model: an ensemble's versions share one config, so the baseline loaded beside a canary
    # ensemble runs the canary's steps; with no other node, it is not compared at all.
    plain = rollout.model.kind != Model.Kind.ENSEMBLE
    baseline_node = others[0] if others else (canary[0] if plain and lead.beside else None)
    return evaluation_start(
        set_id=found.pk,
        version=lead.canary,
        baseline_version=lead.baseline if baseline_node else None,
        node=canary[0],
        baseline_node=baseline_node,
        concurrency=spec.quality_concurrency,
        timeout_s=spec.quality_timeout_s,
        purpose=f"rollout #{rollout.pk}, {when}",
        actor=ACTOR,
    )


def evaluate_everywhere(
    rollout: Rollout, spec: Analysis, changed: list[ChangedStep], nodes: list[Node]
) -> list[EvaluationRun]:
    """Before a blue-green switch: each changed step's evaluation set against its new version
    and the one it replaces, both loaded on every node, node by node (each node loaded its own
    copy: one that loaded it wrong is found). Raises QualityError."""
    runs = []
    for step in changed:
        found = pinned_set(rollout, step.model)
        if found is None:
            raise QualityError(f"{step.model} has no evaluation set {spec.quality_set!r}")
        runs += [
            evaluation_start(
                set_id=found.pk,
                version=step.canary,
                baseline_version=step.baseline,
                node=node,
                baseline_node=node,
                concurrency=spec.quality_concurrency,
                timeout_s=spec.quality_timeout_s,
                purpose=f"rollout #{rollout.pk}, before the switch",
                actor=ACTOR,
            )
            for node in nodes
        ]
    return runs


SHOWN = 3  # nodes named in a finding; the rest are counted


def everywhere_verdicts(runs: list[EvaluationRun], spec: Analysis) -> list[Result]:
    """One result per step evaluated before a blue-green switch: its worst node decides (a
    failure, else a run that could not run); the evidence names each node's run."""
    by_step: dict[str, list[EvaluationRun]] = {}
    for run in runs:
        by_step.setdefault(run.evaluation_set.model.name, []).append(run)
    found = []
    for step, each in sorted(by_step.items()):
        judged = [(run, *evaluation_verdict(run, spec)) for run in each]
        verdict = next(
            (v for v in (Verdict.FAILURE, Verdict.INCONCLUSIVE) if any(j[1] == v for j in judged)),
            Verdict.SUCCESS,
        )
        bad = [f"{run.node}: {detail}" for run, v, detail in judged if v == verdict]
        more = f"; and {len(bad) - SHOWN} more nodes" if len(bad) > SHOWN else ""
        detail = "" if verdict == Verdict.SUCCESS else "; ".join(bad[:SHOWN]) + more
        scores = [run.score for run in each if run.score is not None]
        baselines = [run.baseline_score for run in each if run.baseline_score is not None]
        found.append(
            Result(
                f"quality before the switch: {step}",
                f"{len(each)} evaluation runs of {each[0].evaluation_set}, "
                f"v{each[0].version} against v{each[0].baseline_version}",
                min(scores, default=None),
                min(baselines, default=None),
                spec.quality_min_score,
                verdict,
                detail or f"every node passed: {judged[0][2]} on {judged[0][0].node}",
                {"runs": {str(run.node): run.pk for run in each}},
            )
        )
    return found


def evaluated(
    rollout: Rollout, spec: Analysis, *, lead: Release, canary: list[Node], nodes: list[Node]
) -> list[Result]:
    """During a step, the evaluation set again every `quality_every` rounds: a finished run's
    verdict joins the round that finds it, and the next run starts when one is due. One that
    has not finished by its deadline is inconclusive: never a pass on missing answers."""
    if not (spec.quality_set and spec.quality_every):
        return []
    found: list[Result] = []
    run = rollout.quality_run
    now = timezone.now()
    if run is not None and (run.finished or now > gate_deadline(run, spec)):
        verdict, detail = (
            evaluation_verdict(run, spec)
            if run.finished
            else (Verdict.INCONCLUSIVE, f"evaluation run #{run.pk} did not finish in time")
        )
        found.append(
            Result(
                "quality (evaluation)",
                f"evaluation run #{run.pk}: {run.evaluation_set}",
                run.score,
                run.baseline_score,
                spec.quality_min_score,
                verdict,
                "" if verdict == Verdict.SUCCESS else detail,
                {"run": run.pk, "passed": run.passed, "failed": run.failed},
            )
        )
        run = rollout.quality_run = None
    rounds = rollout.measurements.filter(step=rollout.step, metric="requests").count() + 1
    if run is None and rounds % spec.quality_every == 0:
        try:
            rollout.quality_run = evaluate(
                rollout,
                spec,
                lead=lead,
                canary=canary,
                nodes=nodes,
                when=f"step {rollout.step + 1}",
            )
        except QualityError as exc:
            found.append(
                Result("quality (evaluation)", "", None, None, None, Verdict.INCONCLUSIVE, str(exc))
            )
    return found


def gate_deadline(run: EvaluationRun, spec: Analysis) -> datetime:
    """When a run that has not finished is given up: every case at its timeout, a round of
    `concurrency` at a time, for both versions, plus a minute to reach a worker; never past
    the worker's hard limit (a run killed there stays running) and that minute."""
    cases = run.evaluation_set.cases.count()
    rounds = -(-cases // run.concurrency) * (2 if run.baseline_version else 1)
    seconds = min(rounds * run.timeout_s, RUN_TIME_LIMIT_S)
    return run.created_at + timedelta(seconds=60 + seconds)


def evaluation_verdict(run: EvaluationRun, spec: Analysis) -> tuple[Verdict, str]:
    """Success, or failure with what failed: the score below the minimum, or too far below
    the baseline's, or no case judged at all (never passed on missing answers)."""
    if run.status == EvaluationRun.Status.FAILED:  # missing answers: never a pass, nor a fail
        return Verdict.INCONCLUSIVE, f"evaluation run #{run.pk} could not run: {run.error}"
    if run.score is None:
        return Verdict.FAILURE, "no case was judged"
    failing = failing_cases(run, limit=5)
    named = f"; failing: {', '.join(failing)}{', ...' if run.failed > 5 else ''}" if failing else ""
    score = f"canary scored {run.score:.0%} ({run.passed} of {run.passed + run.failed} cases)"
    if run.score < spec.quality_min_score:
        return Verdict.FAILURE, f"{score}, below {spec.quality_min_score:.0%}{named}"
    if run.baseline_score is not None and run.score < run.baseline_score - spec.quality_tolerance:
        return (
            Verdict.FAILURE,
            f"{score}, the baseline {run.baseline_score:.0%}: more than "
            f"{spec.quality_tolerance:.0%} below it{named}",
        )
    return Verdict.SUCCESS, score + (
        f", the baseline {run.baseline_score:.0%}" if run.baseline_score is not None else ""
    )


def drive_evidence(
    rollout: Rollout, spec: Analysis, canary: list[Node], nodes: list[Node], now: datetime
) -> None:
    """Once a round finds a side with fewer requests than the judge needs, the evaluation set's
    inputs go to that side's nodes at `synthetic_rps`, a window and two intervals at a time,
    for the rest of the step: the judge gets its evidence instead of guessing, and the step's
    measurements say which requests were made (`labelled`)."""
    load = rollout.synthetic_load
    if not spec.synthetic_rps or (load is not None and _covers(load, now, spec.interval_s)):
        return
    names = load.nodes if load is not None else _short_sides(rollout, spec, canary, nodes)
    if not names:
        return
    found = pinned_set(rollout, rollout.model.name)
    if found is None:
        return  # its absence pauses the gate, and rounds say why they are inconclusive
    seconds = spec.window_s + 2 * spec.interval_s
    try:
        rollout.synthetic_load = synthetic_load_start(
            set_id=found.pk,
            nodes=[n for n in nodes if n.name in names],
            rps=spec.synthetic_rps,
            seconds=seconds,
            purpose=f"rollout #{rollout.pk}, step {rollout.step + 1}: too few requests to judge",
            actor=ACTOR,
        )
    except QualityError as exc:
        log.warning("rollout #%s: no synthetic requests: %s", rollout.pk, exc)
        return
    rollout.save()


def _covers(load: SyntheticLoad, now: datetime, margin_s: int) -> bool:
    return load.created_at + timedelta(seconds=load.seconds - margin_s) > now


def _short_sides(
    rollout: Rollout, spec: Analysis, canary: list[Node], nodes: list[Node]
) -> list[str]:
    """The nodes of each side that served fewer than `min_requests` in the last round."""
    last = (
        rollout.measurements.filter(step=rollout.step, metric="requests")
        .order_by("-taken_at", "-id")
        .first()
    )
    if last is None:
        return []
    short = []
    if last.canary_value is not None and last.canary_value < spec.min_requests:
        short += [n.name for n in canary]
    if last.baseline_value is not None and last.baseline_value < spec.min_requests:
        short += [n.name for n in nodes if n not in canary]
    return short


def filling(rollout: Rollout, spec: Analysis, now: datetime) -> bool:
    """Whether synthetic requests began less than a window (and a round) ago: the window the
    judge reads is not full of them yet."""
    load = rollout.synthetic_load
    if load is None:
        return False
    began = (
        rollout.measurements.filter(
            step=rollout.step, metric="requests", evidence__has_key="synthetic"
        )
        .order_by("taken_at", "id")
        .values_list("taken_at", flat=True)
        .first()
    ) or load.created_at
    return (now - began).total_seconds() < spec.window_s + spec.interval_s


def labelled(rollout: Rollout, results: list[Result]) -> list[Result]:
    """The round's request counts, saying which of them the rollout made."""
    load = rollout.synthetic_load
    if load is None:
        return results
    note = (
        f"{load.rps:g} synthetic requests/s from {load.evaluation_set} to "
        f"{', '.join(load.nodes)} since {load.created_at:%H:%M:%S}"
    )
    made = {"load": load.pk, "rps": load.rps, "nodes": load.nodes, "sent": load.sent}
    return [
        replace(
            r,
            detail="; ".join(filter(None, [r.detail, note])),
            evidence=r.evidence | {"synthetic": made},
        )
        if r.metric == "requests"
        else r
        for r in results
    ]
