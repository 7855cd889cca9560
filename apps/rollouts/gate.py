"""A rollout's gates before traffic, quality then performance (apps/rollouts/perf_gate.py), and
its evaluation runs and the gates they make: the quality gate (once the first step's canary is
READY, before any user request reaches it, the rollout's evaluation set runs against canary and
baseline, case by case, each version asked by number: it passes, and the step's share goes
out, or the rollout is rolled back before a single user request reached the canary), the set
again during the steps, and each changed step's set on every node before a
blue-green switch; when a run is given up, and the verdict of a run."""

from datetime import datetime, timedelta

from django.utils import timezone

from apps.fleet.models import Node
from apps.quality.errors import QualityError
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.quality.selectors import failing_cases
from apps.quality.services import evaluation_start
from apps.quality.tasks import RUN_TIME_LIMIT_S
from apps.registry.models import Model
from apps.rollouts.ending import roll_back
from apps.rollouts.members import ChangedStep, Scope
from apps.rollouts.models import Rollout, Round
from apps.rollouts.perf_gate import perf_gate
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import ACTOR, pause, record
from apps.rollouts.verdicts import Verdict


def gate_pending(rollout: Rollout) -> bool:
    """Whether the canary still has a gate to pass before any traffic: quality, performance."""
    spec = Analysis.from_dict(rollout.analysis)
    return rollout.step == 0 and (
        (bool(spec.quality_set) and rollout.gate_passed_at is None)
        or (bool(spec.perf_concurrency) and rollout.perf_passed_at is None)
    )


def gate(rollout: Rollout, where: Scope, spec: Analysis, now: datetime) -> bool:
    """Whether the gates before traffic passed now: the quality gate, then the performance
    gate (apps/rollouts/perf_gate.py)."""
    if spec.quality_set and rollout.gate_passed_at is None:
        if not quality_gate(rollout, where, spec, now):
            return False
        rollout.save()  # passed: kept, whatever the performance gate does next
    if spec.perf_concurrency and rollout.perf_passed_at is None:
        return perf_gate(rollout, where, spec, now)
    return True


def quality_gate(rollout: Rollout, where: Scope, spec: Analysis, now: datetime) -> bool:
    """Whether the quality gate passed now; until then its run starts, is waited on (paused when
    it did not finish in time), and is judged: a failure rolls back, too little evidence
    pauses."""
    run = rollout.gate_run
    if run is None:
        try:
            rollout.gate_run = evaluate(rollout, spec, where, when="before traffic")
        except QualityError as exc:
            pause(rollout, f"quality gate: {exc}")
            return False
        rollout.save()
        return False
    if not run.finished:
        if now > gate_deadline(run, spec):
            rollout.gate_run = None  # a resume starts a new run
            pause(
                rollout,
                f"quality gate: evaluation run #{run.pk} did not finish in time (its worker may "
                "have been lost); resume to run it again",
            )
        return False
    found = gate_measured(run, spec)
    verdict, detail = found.verdict, found.detail
    record(rollout, [found], verdict, Round.Kind.GATE)
    if verdict == Verdict.INCONCLUSIVE:
        rollout.gate_run = None  # a resume runs it again
        pause(rollout, f"quality gate: {detail}; resume to run it again")
        return False
    if verdict != Verdict.SUCCESS:
        rollout.first_failure_at = rollout.first_failure_at or now
        roll_back(rollout, f"quality gate failed before any traffic: {detail}")
        return False
    rollout.gate_passed_at = now
    return True


def gate_measured(run: EvaluationRun, spec: Analysis) -> Result:
    """The gate's one measurement: the run's scores against the minimum, and its verdict."""
    verdict, detail = evaluation_verdict(run, spec)
    return Result(
        "quality before traffic",
        f"evaluation run #{run.pk}: {run.evaluation_set}",
        run.score,
        run.baseline_score,
        spec.quality_min_score,
        verdict,
        detail,
        {"run": run.pk, "passed": run.passed, "failed": run.failed},
        kind=Kind.QUALITY,
    )


def evaluated(rollout: Rollout, spec: Analysis, where: Scope) -> list[Result]:
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
                kind=Kind.QUALITY,
            )
        )
        run = rollout.quality_run = None
    measured = rollout.rounds.filter(step=rollout.step, kind=Round.Kind.ANALYSIS)
    rounds = measured.exclude(verdict=Verdict.ERROR).count() + 1  # this one among them
    if run is None and rounds % spec.quality_every == 0:
        try:
            rollout.quality_run = evaluate(rollout, spec, where, when=f"step {rollout.step + 1}")
        except QualityError as exc:
            found.append(
                Result(
                    "quality (evaluation)",
                    "",
                    None,
                    None,
                    None,
                    Verdict.INCONCLUSIVE,
                    str(exc),
                    kind=Kind.QUALITY,
                )
            )
    return found


def pinned_set(rollout: Rollout, model: str) -> EvaluationSet | None:
    """The evaluation set the rollout's gates run for `model`: the version pinned when it
    started (what an approval showed), never one imported since."""
    pk = rollout.quality_sets.get(model)
    return EvaluationSet.objects.filter(pk=pk).first() if pk else None


def evaluate(rollout: Rollout, spec: Analysis, where: Scope, *, when: str) -> EvaluationRun:
    """Queue the rollout's evaluation set against the canary, on a canary node, and against the
    baseline where a node serves it. Raises QualityError."""
    lead, canary, nodes = where.lead, where.canary, where.nodes
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
                kind=Kind.QUALITY,
            )
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
