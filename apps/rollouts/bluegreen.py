"""Blue-green releases of a pipeline: its changed steps on standby beside the ones serving on
every node, evaluated there, then one switch of every node."""

from django.utils import timezone

from apps.fleet import selectors
from apps.fleet.models import Node
from apps.fleet.services.deployments import deployment_set
from apps.quality.errors import QualityError
from apps.rollouts.analysis import overall
from apps.rollouts.ending import promote, roll_back
from apps.rollouts.gate import evaluate_everywhere, everywhere_verdicts, gate_deadline
from apps.rollouts.members import changed_steps, members, pool_deployments, pool_nodes
from apps.rollouts.models import Rollout, Round
from apps.rollouts.plans import Analysis
from apps.rollouts.steps import stalled
from apps.rollouts.transitions import ACTOR, State, pause, record, transition
from apps.rollouts.verdicts import Verdict


def blue_green(rollout: Rollout) -> None:
    """A blue-green release: the new pipeline release's changed steps load beside the ones
    serving on every node (the pool's deployment keeps serving the release before, the new one
    on standby); each is evaluated on every node against the version it replaces; then every
    node switches at once, only reloading the pipeline. A failed evaluation lets the standby
    go: the release before never stopped serving."""
    spec = Analysis.from_dict(rollout.analysis)
    nodes = pool_nodes(rollout)
    if not nodes:
        return pause(rollout, f"pool {rollout.pool.name} has no nodes")
    lead = members(rollout)[0]
    now = timezone.now()
    if rollout.step_started_at is None:
        serving = pool_deployments(rollout, [lead])[lead.model.name]
        deployment_set(
            model_name=lead.model.name,
            version=serving.version,
            pool=rollout.pool,
            actor=ACTOR,
            baseline=serving.baseline_version,  # a rollback window still open stays open
            baseline_until=serving.baseline_until,
            standby=lead.canary,
        )
        rollout.canary_nodes = [n.name for n in nodes]
        rollout.step_started_at, rollout.step_ready_at = now, None
        return transition(rollout, State.PROGRESSING, event="standby")
    down = [n.name for n in nodes if n.health == Node.Health.UNREACHABLE]
    if down:
        return pause(rollout, f"node {', '.join(down)} is unreachable; resume when it is back")
    changed = changed_steps(lead)
    if rollout.step_ready_at is None:
        readings = selectors.observed_many(nodes, [c.model for c in changed])
        waiting = [
            n
            for n in nodes
            if any(not {c.baseline, c.canary} <= readings[(n.pk, c.model)][0] for c in changed)
        ]
        if waiting:
            what = ", ".join(f"{c.model} v{c.canary} beside v{c.baseline}" for c in changed)
            return stalled(rollout, waiting, [c.model for c in changed], what, spec, now)
        rollout.step_ready_at = now
        rollout.save()
    runs = list(rollout.gate_runs.select_related("evaluation_set__model", "node").order_by("pk"))
    if not runs:
        try:
            rollout.gate_runs.set(evaluate_everywhere(rollout, spec, changed, nodes))
        except QualityError as exc:
            return pause(rollout, f"evaluation before the switch: {exc}")
        return None
    if not all(run.finished for run in runs):
        # The runs of one set share their cases and limits: its newest decides (a query each).
        newest = {run.evaluation_set_id: run for run in runs}.values()
        if now > max(gate_deadline(run, spec) for run in newest):
            rollout.gate_runs.clear()  # a resume runs them again
            return pause(
                rollout,
                "evaluation before the switch did not finish in time (a worker may have been "
                "lost); resume to run it again",
            )
        return None
    results = everywhere_verdicts(runs, spec)
    verdict = overall(results)
    record(rollout, results, verdict, Round.Kind.SWITCH)
    findings = "; ".join(f"{r.name}: {r.detail}" for r in results if r.verdict == verdict)
    if verdict == Verdict.INCONCLUSIVE:
        rollout.gate_runs.clear()
        return pause(rollout, f"{findings}; resume to run it again")
    if verdict != Verdict.SUCCESS:
        rollout.first_failure_at = now
        return roll_back(
            rollout, f"failed before the switch, still serving the release before: {findings}"
        )
    rollout.gate_passed_at = now
    transition(rollout, State.PROMOTING, event="switch")
    return promote(rollout)  # the switch goes out in this same tick
