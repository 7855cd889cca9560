"""The rollout state machine, advanced by a periodic task. One tick takes the rollout's row lock,
does at most one transition and saves it; everything it needs is in the database, so any process
may be killed at any point and the next tick carries on without repeating a step.

    pending -> progressing (step i) <-> paused -> promoting -> succeeded
    (any active state) -> aborting -> rolled_back;  failed when the fleet cannot do what it must.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.accounts.permissions import moving_back
from apps.audit.services import actor_name, audit_record
from apps.fleet.desired import Want, Wanted, fleet_desired
from apps.fleet.memory import shortfalls
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.routing import share_weights, weights_reset, weights_set
from apps.fleet.selectors import observed_many
from apps.fleet.services import FleetError, deployment_remove, deployment_set
from apps.observability.prometheus import PrometheusUnavailable
from apps.quality.errors import QualityError
from apps.registry.codec import from_dict
from apps.registry.ensembles import UnresolvedStep, pinned_steps
from apps.registry.models import Model
from apps.registry.selectors import registry_resolver
from apps.rollouts.analysis import ChangedStep, Result, measure, overall
from apps.rollouts.gates import (
    ACTOR,
    drive_evidence,
    evaluate,
    evaluate_everywhere,
    evaluated,
    evaluation_verdict,
    everywhere_verdicts,
    filling,
    gate_deadline,
    labelled,
)
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.notify import notify
from apps.rollouts.plans import Analysis, canary_nodes, parse_plan
from apps.rollouts.slo import Objectives

log = logging.getLogger(__name__)
TICK_ERROR_LIMIT = 3
Actor = str | User
State = Rollout.State
Verdict = Measurement.Verdict


def rollout_advance(*, rollout_id: int) -> None:
    try:
        # Prometheus may take its whole timeout to answer: measured before the row lock, so a
        # person's pause or abort never waits behind it; used only if nothing moved meanwhile.
        reading = _measure_ahead(rollout_id)
        with transaction.atomic():
            rollout = (
                Rollout.objects.select_for_update()
                .select_related("model", "pool")
                .get(pk=rollout_id)
            )
            handler = HANDLERS.get(rollout.state)
            if handler is not None:
                handler(rollout, reading)
            if rollout.tick_errors:
                Rollout.objects.filter(pk=rollout_id).update(tick_errors=0, tick_error="")
    except Exception as exc:  # a bug, or the database away: a rollout must not stall unseen
        _tick_failed(rollout_id, exc)
        raise


def _tick_failed(rollout_id: int, exc: Exception) -> None:
    """Record the failure on the rollout, for its page; after TICK_ERROR_LIMIT in a row a rollout
    still moving forward pauses, so that a person looks. One aborting or promoting keeps trying:
    stopping half-way would be worse."""
    log.exception("rollout #%s: tick failed", rollout_id)
    try:
        with transaction.atomic():
            rollout = Rollout.objects.select_for_update().select_related("model").get(pk=rollout_id)
            rollout.tick_errors += 1
            rollout.tick_error = f"{type(exc).__name__}: {exc}"[:2000]
            rollout.save(update_fields=["tick_errors", "tick_error", "updated_at"])
            forward = rollout.state in (State.PENDING, State.PROGRESSING)
            if forward and rollout.tick_errors >= TICK_ERROR_LIMIT:
                why = f"the controller failed {rollout.tick_errors} ticks in a row"
                why += f" ({rollout.tick_error})"
                pause(rollout, f"{why}; resume once it is fixed")
    except Exception:  # the database itself may be what failed: the log has it
        log.exception("rollout #%s: could not record the failed tick", rollout_id)


def _nodes(rollout: Rollout) -> list[Node]:
    return list(rollout.pool.nodes.order_by("name"))


def _canary(rollout: Rollout, nodes: list[Node]) -> list[Node]:
    step = parse_plan(rollout.plan)[rollout.step]
    names = set(canary_nodes(step, [n.name for n in nodes]))
    return [n for n in nodes if n.name in names]


@dataclass(frozen=True)
class Member:
    """One model a rollout releases: its own, or one released in lockstep with it."""

    model: Model
    baseline: int
    canary: int

    @property
    def beside(self) -> int | None:
        """The baseline kept READY beside the canary, so that rolling back only narrows the
        version policy; none when the canary's number is lower, since an unversioned request
        goes to the highest READY version."""
        return self.baseline if self.canary > self.baseline else None

    @property
    def versions(self) -> set[int]:
        """What a canary node serves."""
        return {self.canary} | ({self.beside} if self.beside else set())


def members(rollout: Rollout) -> list[Member]:
    """The models a rollout releases, in dependency order: plain models before the pipelines
    that may pin them. They go to the same nodes, are judged together and promote or roll back
    as one."""
    lead = Member(rollout.model, rollout.baseline_version, rollout.canary_version)
    if not rollout.lockstep:
        return [lead]
    models = Model.objects.in_bulk([m["model"] for m in rollout.lockstep], field_name="name")
    found = [
        lead,
        *(Member(models[m["model"]], m["baseline"], m["canary"]) for m in rollout.lockstep),
    ]
    return sorted(found, key=lambda m: m.model.kind == Model.Kind.ENSEMBLE)


def transition(
    rollout: Rollout, state: str, reason: str = "", event: str = "", actor: Actor = ACTOR
) -> None:
    """Save the new state, with one audit event and a webhook message."""
    before = rollout.state
    rollout.state = state
    rollout.reason = reason or rollout.reason
    if state in Rollout.TERMINAL:
        rollout.finished_at = timezone.now()
    rollout.save()
    audit_record(
        actor=actor,
        action=f"rollout.{event or state}",
        target=f"rollout:{rollout.pk}:{rollout.model.name}",
        before={"state": before, "step": rollout.step},
        after={
            "state": state,
            "step": rollout.step,
            "version": rollout.canary_version,
            "pool": rollout.pool.name,  # its target names the rollout and the model, not the pool
        },
        result="failed" if state == State.FAILED else "ok",
        message=reason,
    )
    notify(rollout, event or state)


def pause(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    transition(rollout, State.PAUSED, reason, actor=actor)


def begin_abort(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    """Canary nodes back to the pool's deployment, the baseline, which they still serve: only a
    narrowing. During a promotion the pool itself goes back to the baseline. On a pool whose
    balancer weighs nodes, the canary nodes first get no traffic (where others can take it)
    until the rollback is read back everywhere. A move back: never held for a second person on
    a protected pool."""
    # No request reaches the canary from now on, where other nodes can take them: a canary on
    # every node (a blue-green release's too) narrows in traffic instead.
    others = rollout.pool.nodes.exclude(name__in=rollout.canary_nodes).exists()
    if rollout.pool.traffic and others:
        weights_set(rollout.pool, dict.fromkeys(rollout.canary_nodes, 0), actor_name(actor))
    released = members(rollout)
    pooled = _pooled(rollout, released)
    with moving_back():
        for member in reversed(released):  # pipelines first, then what they pin
            pool = pooled.get(member.model.name)
            if pool is not None and (pool.version == member.canary or pool.standby_version):
                # A blue-green release not switched yet: its standby goes, the rest stays.
                kept = pool.version != member.canary
                deployment_set(
                    model_name=member.model.name,
                    version=member.baseline,
                    pool=rollout.pool,
                    actor=actor,
                    baseline=pool.baseline_version if kept else None,
                    baseline_until=pool.baseline_until if kept else None,
                )
            drop_node_deployments(member.model, rollout.pool, actor)
    transition(rollout, State.ABORTING, reason, actor=actor)


def drop_node_deployments(model: Model, pool: NodePool, actor: Actor) -> None:
    """Every node of the pool back to the pool's own deployment of `model`."""
    for deployment in Deployment.objects.filter(model=model, node__pool=pool):
        deployment_remove(deployment_id=deployment.pk, actor=actor)


@dataclass(frozen=True)
class Reading:
    """An analysis round measured before the rollout's lock was taken, of the rollout as it was
    then (`of`, as `_as_measured` says)."""

    of: tuple[object, ...]
    results: list[Result] = field(default_factory=list)
    error: PrometheusUnavailable | None = None


def _as_measured(rollout: Rollout, compare: bool) -> tuple[object, ...]:
    """What a measurement was taken for: a reading of another step, canary or round is stale."""
    return (
        rollout.state,
        rollout.step,
        rollout.step_started_at,
        rollout.step_ready_at,
        rollout.last_measured_at,
        tuple(rollout.canary_nodes),
        compare,
    )


def _due(rollout: Rollout, spec: Analysis, now: datetime) -> bool:
    """Judged on whole windows of canary traffic, after the load's own spike has passed, every
    interval."""
    if rollout.step_ready_at is None:
        return False
    warm = (now - rollout.step_ready_at).total_seconds() >= spec.warmup_s + spec.window_s
    return warm and (
        rollout.last_measured_at is None
        or (now - rollout.last_measured_at).total_seconds() >= spec.interval_s
    )


def _measure_ahead(rollout_id: int) -> Reading | None:
    """The round a tick is about to judge, if one is due, read without any lock."""
    found = Rollout.objects.select_related("model", "pool").filter(pk=rollout_id).first()
    if found is None or found.state != State.PROGRESSING or found.step_started_at is None:
        return None
    if found.strategy == Rollout.Strategy.BLUE_GREEN:
        return None  # judged on its evaluations alone
    spec = Analysis.from_dict(found.analysis)
    if not _due(found, spec, timezone.now()):
        return None
    nodes = _nodes(found)
    compare = len(_canary(found, nodes)) < len(nodes)
    of = _as_measured(found, compare)
    try:
        return Reading(of, results=_measure(found, spec, compare))
    except PrometheusUnavailable as exc:
        return Reading(of, error=exc)


def _progress(rollout: Rollout, reading: Reading | None = None) -> None:
    if rollout.strategy == Rollout.Strategy.BLUE_GREEN:
        return _blue_green(rollout)
    steps = parse_plan(rollout.plan)
    spec = Analysis.from_dict(rollout.analysis)
    nodes = _nodes(rollout)
    if not nodes:
        return pause(rollout, f"pool {rollout.pool.name} has no nodes")
    canary = _canary(rollout, nodes)
    now = timezone.now()
    if rollout.step_started_at is None:
        _apply_share(rollout, canary, nodes)
        rollout.step_started_at, rollout.step_ready_at = now, None
        rollout.synthetic_load = None  # each step makes requests only where it lacks them
        rollout.last_verdict, rollout.last_measured_at = "", None
        return transition(rollout, State.PROGRESSING, event="step")
    down = [n.name for n in nodes if n.health == Node.Health.UNREACHABLE]
    if down:
        return pause(rollout, f"node {', '.join(down)} is unreachable; resume when it is back")
    if rollout.step_ready_at is None:
        return _await_canary(rollout, canary, spec, now)
    compare = len(canary) < len(nodes)
    drive_evidence(rollout, spec, canary, nodes, now)
    if _due(rollout, spec, now):
        if reading is None or reading.of != _as_measured(rollout, compare):
            return None  # it moved since, or came due since: measured on the next tick
        _analyse(rollout, spec, reading)
        if rollout.state != State.PROGRESSING:
            return None
    held = (now - rollout.step_ready_at).total_seconds() >= steps[rollout.step].hold_s
    # A dry run measures and records its verdicts, and goes on whatever they are.
    stopped = ("",) if spec.dry_run else ("", Verdict.FAILURE, Verdict.ERROR)
    if not held or rollout.last_verdict in stopped:
        return None
    if rollout.last_verdict == Verdict.INCONCLUSIVE and not spec.dry_run:
        if filling(rollout, spec, now):
            return None  # the requests the judge needs are being made: it waits for them
        return pause(rollout, f"inconclusive: {_last_round_details(rollout)}")
    if rollout.step + 1 < len(steps):
        rollout.step += 1
        rollout.step_started_at = None
        rollout.save()
        return _progress(rollout)  # the next share goes out in this same tick
    return transition(rollout, State.PROMOTING)


def _last_round_details(rollout: Rollout) -> str:
    """What the last analysis round found, once per distinct finding."""
    found = rollout.measurements.filter(taken_at__gte=rollout.last_measured_at).exclude(
        verdict=Verdict.SUCCESS
    )
    details = dict.fromkeys(m.detail for m in found.order_by("taken_at", "id") if m.detail)
    return "; ".join(details) or "no data"


def _apply_share(rollout: Rollout, canary: list[Node], nodes: list[Node]) -> None:
    """The step's canary nodes get the canary; on a pool whose balancer weighs nodes, they get
    the step's exact share of requests (the nodes loading it are drained meanwhile)."""
    rollout.canary_nodes = [node.name for node in canary]
    if rollout.pool.traffic:
        step = parse_plan(rollout.plan)[rollout.step]
        each, rest = share_weights(step.percent or 100, len(canary), len(nodes))
        if step.percent is None:  # a step in nodes: as many requests as any other node
            each = rest
        if gate_pending(rollout):  # no request reaches the canary before its answers are right
            each = 0
        weights = {node.name: each if node in canary else rest for node in nodes}
        weights_set(rollout.pool, weights, ACTOR)
    for member in members(rollout):
        for node in canary:
            deployment_set(
                model_name=member.model.name,
                version=member.canary,
                baseline=member.beside,
                node=node,
                actor=ACTOR,
            )


def _await_canary(rollout: Rollout, canary: list[Node], spec: Analysis, now: datetime) -> None:
    released = members(rollout)
    wanted = {m.model.name: m.versions for m in released}
    readings = observed_many(canary, list(wanted))
    waiting = [
        n for n in canary if any(readings[(n.pk, name)][0] != v for name, v in wanted.items())
    ]
    if not waiting:
        if gate_pending(rollout):
            return _gate(rollout, canary, spec, now)
        rollout.step_ready_at = now
        rollout.save()
        return None
    what = ", ".join(f"{m.model.name} v{m.canary}" for m in released)
    return _stalled(rollout, waiting, list(wanted), what, spec, now)


def _stalled(
    rollout: Rollout,
    waiting: list[Node],
    models: list[str],
    what: str,
    spec: Analysis,
    now: datetime,
) -> None:
    """Pause a rollout whose nodes do not get to READY: a load of `models` failed, or they
    took longer than the analysis allows."""
    failed = (
        waiting[0]
        .operations.filter(model_name__in=models, finished_at__gte=rollout.step_started_at)
        .exclude(status__in=["succeeded", "cancelled", *Operation.OPEN])
        .first()
    )
    if failed is not None:
        return pause(rollout, f"{waiting[0].name}: {failed.kind} failed: {failed.error}")
    assert rollout.step_started_at is not None
    if (now - rollout.step_started_at).total_seconds() > spec.converge_timeout_s:
        names = ", ".join(n.name for n in waiting)
        return pause(rollout, f"{what} not READY on {names} after {spec.converge_timeout_s} s")
    return None


def _blue_green(rollout: Rollout) -> None:
    """A blue-green release: the new pipeline release's changed steps load beside the ones
    serving on every node (the pool's deployment keeps serving the release before, the new one
    on standby); each is evaluated on every node against the version it replaces; then every
    node switches at once, only reloading the pipeline. A failed evaluation lets the standby
    go: the release before never stopped serving."""
    spec = Analysis.from_dict(rollout.analysis)
    nodes = _nodes(rollout)
    if not nodes:
        return pause(rollout, f"pool {rollout.pool.name} has no nodes")
    lead = members(rollout)[0]
    now = timezone.now()
    if rollout.step_started_at is None:
        serving = _pooled(rollout, [lead])[lead.model.name]
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
        readings = observed_many(nodes, [c.model for c in changed])
        waiting = [
            n
            for n in nodes
            if any(not {c.baseline, c.canary} <= readings[(n.pk, c.model)][0] for c in changed)
        ]
        if waiting:
            what = ", ".join(f"{c.model} v{c.canary} beside v{c.baseline}" for c in changed)
            return _stalled(rollout, waiting, [c.model for c in changed], what, spec, now)
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
        if now > max(gate_deadline(run, spec) for run in runs):
            rollout.gate_runs.clear()  # a resume runs them again
            return pause(
                rollout,
                "evaluation before the switch did not finish in time (a worker may have been "
                "lost); resume to run it again",
            )
        return None
    results = everywhere_verdicts(runs, spec)
    _record(rollout, results)
    verdict = overall(results)
    findings = "; ".join(f"{r.metric}: {r.detail}" for r in results if r.verdict == verdict)
    if verdict == Verdict.INCONCLUSIVE:
        rollout.gate_runs.clear()
        return pause(rollout, f"{findings}; resume to run it again")
    if verdict != Verdict.SUCCESS:
        rollout.first_failure_at = now
        return begin_abort(
            rollout, f"failed before the switch, still serving the release before: {findings}"
        )
    rollout.gate_passed_at = now
    transition(rollout, State.PROMOTING, event="switch")
    return _promote(rollout)  # the switch goes out in this same tick


def gate_pending(rollout: Rollout) -> bool:
    """Whether the canary still has its quality gate to pass before any traffic."""
    spec = Analysis.from_dict(rollout.analysis)
    return bool(spec.quality_set) and rollout.step == 0 and rollout.gate_passed_at is None


def _gate(rollout: Rollout, canary: list[Node], spec: Analysis, now: datetime) -> None:
    """The canary is READY and has no traffic yet: its evaluation set runs against canary and
    baseline, case by case, each version asked by number. It passes, and the step's share goes
    out, or the rollout is rolled back before a single user request reached the canary."""
    run = rollout.gate_run
    if run is None:
        return _gate_start(rollout, canary, spec)
    if not run.finished:
        if now > gate_deadline(run, spec):
            rollout.gate_run = None  # a resume starts a new run
            return pause(
                rollout,
                f"quality gate: evaluation run #{run.pk} did not finish in time (its worker may "
                "have been lost); resume to run it again",
            )
        return None
    verdict, detail = evaluation_verdict(run, spec)
    Measurement.objects.create(
        rollout=rollout,
        step=rollout.step,
        metric="quality before traffic",
        query=f"evaluation run #{run.pk}: {run.evaluation_set}",
        canary_value=run.score,
        baseline_value=run.baseline_score,
        threshold=spec.quality_min_score,
        verdict=verdict,
        detail=detail,
        evidence={"run": run.pk, "passed": run.passed, "failed": run.failed},
    )
    if verdict == Verdict.INCONCLUSIVE:
        rollout.gate_run = None  # a resume runs it again
        return pause(rollout, f"quality gate: {detail}; resume to run it again")
    if verdict != Verdict.SUCCESS:
        rollout.first_failure_at = rollout.first_failure_at or now
        return begin_abort(rollout, f"quality gate failed before any traffic: {detail}")
    rollout.gate_passed_at = now
    _apply_share(rollout, canary, _nodes(rollout))  # now with the step's share of requests
    rollout.step_ready_at = now
    rollout.save()
    return None


def _gate_start(rollout: Rollout, canary: list[Node], spec: Analysis) -> None:
    lead, nodes = members(rollout)[0], _nodes(rollout)
    try:
        rollout.gate_run = evaluate(
            rollout, spec, lead=lead, canary=canary, nodes=nodes, when="before traffic"
        )
    except QualityError as exc:
        return pause(rollout, f"quality gate: {exc}")
    rollout.save()
    return None


def _measure(rollout: Rollout, spec: Analysis, compare: bool) -> list[Result]:
    others = [n.name for n in _nodes(rollout) if n.name not in rollout.canary_nodes]
    return [
        # A lockstep member's metrics carry its name; any member failing fails the step.
        found
        if member.model == rollout.model
        else replace(found, metric=f"{member.model.name}: {found.metric}")
        for member in members(rollout)
        for found in measure(
            model=member.model.name,
            pool=rollout.pool.name,
            canary_nodes=rollout.canary_nodes,
            # The analysis's own metrics are the rollout's: judged once, with its model's versions.
            spec=spec if member.model == rollout.model else replace(spec, metrics=()),
            budget_ms=member.model.latency_budget_ms,
            steps=changed_steps(member),
            compare=compare,
            slo=Objectives.of(member.model),
            canary_version=member.canary,
            baseline_version=member.baseline,
            baseline_nodes=others,
        )
    ]


def _analyse(rollout: Rollout, spec: Analysis, reading: Reading) -> None:
    now = timezone.now()
    rollout.last_measured_at = now
    results, exc = reading.results, reading.error
    if exc is not None:
        Measurement.objects.create(
            rollout=rollout,
            step=rollout.step,
            metric="prometheus",
            query="",
            verdict=Verdict.ERROR,
            detail=str(exc),
        )
        rollout.errors += 1
        rollout.last_verdict = Verdict.ERROR
        if rollout.errors >= spec.error_limit and not spec.dry_run:
            return begin_abort(
                rollout, f"error: Prometheus failed {rollout.errors} times in a row: {exc}"
            )
        rollout.save()
        return None
    nodes = _nodes(rollout)
    lead, canary = members(rollout)[0], _canary(rollout, nodes)
    judged = evaluated(rollout, spec, lead=lead, canary=canary, nodes=nodes)
    results = labelled(rollout, [*results, *judged])
    _record(rollout, results)
    rollout.errors = 0
    rollout.last_verdict = overall(results, spec.pass_score)
    if rollout.last_verdict == Verdict.FAILURE and not spec.dry_run:
        rollout.failures += 1
        rollout.first_failure_at = rollout.first_failure_at or now
        if rollout.failures >= spec.failure_limit:
            why = "; ".join(f"{r.metric}: {r.detail}" for r in results if r.verdict == "failure")
            return begin_abort(rollout, f"failure: {why}")
    rollout.save()
    return None


def _record(rollout: Rollout, results: list[Result]) -> None:
    Measurement.objects.bulk_create(
        Measurement(
            rollout=rollout,
            step=rollout.step,
            metric=r.metric,
            query=r.query,
            canary_value=r.canary,
            baseline_value=r.baseline,
            threshold=r.threshold,
            verdict=r.verdict,
            detail=r.detail,
            evidence=r.evidence,
        )
        for r in results
    )


def changed_steps(member: Member) -> list[ChangedStep]:
    """The steps an ensemble release pins at another version than its baseline does."""
    configs = dict(
        member.model.versions.filter(version__in=[member.baseline, member.canary]).values_list(
            "version", "config"
        )
    )
    resolve = registry_resolver()

    def pins(version: int) -> dict[str, int]:
        if version not in configs:
            return {}
        try:
            steps = pinned_steps(from_dict(configs[version]), resolve)
        except UnresolvedStep:  # no longer loadable: nothing to compare
            return {}
        return {name: number for name, number in steps}

    canary, baseline = pins(member.canary), pins(member.baseline)
    budgets = dict(Model.objects.filter(name__in=canary).values_list("name", "latency_budget_ms"))
    return [
        ChangedStep(name, version, before, budgets.get(name))
        for name, version in sorted(canary.items())
        if (before := baseline.get(name)) is not None and before != version
    ]


def _promote(rollout: Rollout) -> None:
    """The pool moves to the canary, canary nodes drop their own deployments; done when every
    node is read back serving the canary (of every model released together) and, for the pool's
    rollback window, the baseline beside it, loaded but not served: an unversioned request goes
    to the highest version, and a rollback inside the window only narrows."""
    released = members(rollout)
    pooled = _pooled(rollout, released)
    moving = [
        m for m in released if (d := pooled.get(m.model.name)) is None or d.version != m.canary
    ]
    if moving:
        window = rollout.pool.rollback_window_s
        if window and (short := _no_room_beside(rollout, moving)):
            window = 0
            audit_record(
                actor=ACTOR,
                action="rollout.window_skipped",
                target=f"rollout:{rollout.pk}:{rollout.model.name}",
                message="the release before is not kept loaded for the rollback window, for "
                f"want of memory beside the new one: {'; '.join(short)}",
            )
        until = timezone.now() + timedelta(seconds=window)
        try:
            for member in moving:  # in dependency order
                keep = member.beside if window else None
                deployment_set(
                    model_name=member.model.name,
                    version=member.canary,
                    pool=rollout.pool,
                    actor=ACTOR,
                    baseline=keep,
                    baseline_until=until if keep else None,
                )
        except FleetError as exc:
            return transition(rollout, State.FAILED, f"promotion failed: {exc}")
        for member in moving:
            drop_node_deployments(member.model, rollout.pool, ACTOR)
        return None
    serving = {name: _serves(d) for name, d in pooled.items()}
    if _all_serve(rollout, serving) is not None:
        weights_reset(rollout.pool, ACTOR)
        return transition(rollout, State.SUCCEEDED)
    return None


def _no_room_beside(rollout: Rollout, moving: list[Member]) -> list[str]:
    """Where the releases before, kept loaded beside the new ones for the rollback window, would
    not fit (on the pool's memory-aware nodes): on canary nodes already serving both too, since
    a node short of its desired state never converges."""
    change: Wanted = {
        m.model.name: Want(m.canary, m.beside, f"{m.model.name} v{m.canary}, promoted")
        for m in moving
        if m.beside
    }
    if not change:
        return []
    nodes = list(rollout.pool.nodes.all())
    return shortfalls(nodes, fleet_desired(pool_ids=[rollout.pool.pk]), change, new_only=False)


def _aborting(rollout: Rollout) -> None:
    released = members(rollout)
    for member in released:  # a step may have raced the abort
        drop_node_deployments(member.model, rollout.pool, ACTOR)
    pooled = _pooled(rollout, released)
    # What the pool's own deployment serves, the release before it too while its rollback window
    # lasts: a rollout started inside that window is rolled back to both, not to the first alone.
    targets = {
        m.model.name: _serves(d) if (d := pooled.get(m.model.name)) else {m.baseline}
        for m in released
    }
    first = rollout.pool.nodes.first()
    if rollout.strategy == Rollout.Strategy.BLUE_GREEN and first:  # its standby steps let go
        desired = fleet_desired(pool_ids=[rollout.pool.pk]).of(first)
        targets |= {c.model: set(desired[c.model].versions) for c in changed_steps(released[0])}
    done_at = _all_serve(rollout, targets, timed=rollout.canary_nodes)
    if done_at is not None:
        rollout.rolled_back_at = done_at
        weights_reset(rollout.pool, ACTOR)
        transition(rollout, State.ROLLED_BACK)


def _serves(deployment: Deployment) -> set[int]:
    """The versions a deployment keeps READY: its own, and the one kept beside it."""
    return {v for v in (deployment.version, deployment.baseline_version) if v}


def _pooled(rollout: Rollout, released: list[Member]) -> dict[str, Deployment]:
    """The pool's own deployments of the models the rollout releases, by model name."""
    found = Deployment.objects.filter(model__in=[m.model for m in released], pool=rollout.pool)
    return {d.model.name: d for d in found.select_related("model")}


def _all_serve(
    rollout: Rollout, versions: dict[str, set[int]], timed: list[str] | None = None
) -> datetime | None:
    """None while a node of the pool is not read back serving exactly each model's `versions`;
    then since when all of them (or all `timed` nodes) do."""
    nodes = _nodes(rollout)
    found = observed_many(nodes, list(versions))
    if not nodes or any(
        found[(n.pk, name)][0] != wanted for n in nodes for name, wanted in versions.items()
    ):
        return None
    since = [
        found[(n.pk, name)][1] for n in nodes if not timed or n.name in timed for name in versions
    ]
    return max((at for at in since if at is not None), default=timezone.now())


# Each handler gets what was measured before the lock; only a rollout going forward measures.
HANDLERS: dict[str, Callable[[Rollout, Reading | None], None]] = {
    State.PENDING: _progress,
    State.PROGRESSING: _progress,
    State.PROMOTING: lambda rollout, _: _promote(rollout),
    State.ABORTING: lambda rollout, _: _aborting(rollout),
}
