"""What a person (or the API) does to a running rollout and to a pool's release (a rollout
starts in `proposals`). Each action takes the rollout's row lock, checks the state it is allowed
from, and writes one audit event with the change."""

import re
from typing import Any

from django.db import OperationalError, connection, transaction

from apps.accounts.permissions import authorize, moving_back, second_person
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, NodePool, Release
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model
from apps.rollouts.ending import drop_node_deployments, roll_back
from apps.rollouts.models import AnalysisTemplate, Rollout
from apps.rollouts.plans import Analysis, PlanError
from apps.rollouts.proposals import RolloutError, active_rollout, pool_target, rollout_start
from apps.rollouts.selectors import last_good_version
from apps.rollouts.transitions import pause, transition

State = Rollout.State
LOCK_WAIT_S = 5


@audited(
    "analysis_template.save",
    lambda name, **_: f"analysis_template:{name}",
    (RolloutError, PlanError),
)
def template_save(
    *,
    name: str,
    analysis: dict[str, Any],
    actor: Actor,
    model_name: str = "",
    pool_name: str = "",
) -> AnalysisTemplate:
    """The template's next version (its first, for a new name), for `model_name` or
    `pool_name` or any; the same analysis and scope as its latest version is that version."""
    Analysis.from_dict(analysis)  # says which field is wrong, before anything is kept
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,59}", name):
        raise RolloutError(f"template name {name!r}: lowercase letters, digits, '-' and '_'")
    model = Model.objects.filter(name=model_name).first() if model_name else None
    pool = NodePool.objects.filter(name=pool_name).first() if pool_name else None
    if (model_name and model is None) or (pool_name and pool is None):
        missing = f"model {model_name!r}" if model_name and model is None else f"pool {pool_name!r}"
        raise RolloutError(f"no {missing}")
    latest = AnalysisTemplate.objects.select_for_update().filter(name=name).first()
    if latest is not None and (latest.analysis, latest.model, latest.pool) == (
        analysis,
        model,
        pool,
    ):
        return latest
    template = AnalysisTemplate.objects.create(
        name=name,
        version=latest.version + 1 if latest else 1,
        model=model,
        pool=pool,
        analysis=analysis,
        created_by=actor_name(actor),
    )
    audit_record(
        actor=actor,
        target=f"analysis_template:{name}",
        before={"version": latest.version, "analysis": latest.analysis} if latest else {},
        after={
            "version": template.version,
            "analysis": analysis,
            "model": model_name,
            "pool": pool_name,
        },
    )
    return template


def _rollout_target(*, rollout_id: int, **_: object) -> str:
    found = Rollout.objects.filter(pk=rollout_id).values_list("model__name", flat=True).first()
    return f"rollout:{rollout_id}:{found or ''}"


def _locked(rollout_id: int, action: str, allowed: list[State], actor: Actor | None) -> Rollout:
    """The rollout, locked, if `actor` may change it (None: the caller checked already). A tick
    holds the lock only while it writes; should anything hold it longer, a person is told so
    after LOCK_WAIT_S instead of waiting behind it."""
    found = Rollout.objects.select_for_update().select_related("model", "pool")
    try:
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:  # for the rest of this transaction
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT_S}s'")
        rollout = found.filter(pk=rollout_id).first()
    except OperationalError:
        raise RolloutError(
            f"rollout #{rollout_id} is held by another change for over {LOCK_WAIT_S} s; "
            "try again in a moment"
        ) from None
    if rollout is None:
        raise RolloutError(f"there is no rollout #{rollout_id}")
    if actor is not None:
        authorize(actor, "rollouts.change_rollout", rollout.pool)
    if rollout.state not in allowed:
        raise RolloutError(f"rollout #{rollout.pk} is {rollout.state}: cannot {action} it")
    return rollout


@audited("rollout.pause", _rollout_target, (RolloutError, PlanError))
def rollout_pause(*, rollout_id: int, actor: Actor) -> Rollout:
    rollout = _locked(rollout_id, "pause", [State.PENDING, State.PROGRESSING], actor)
    pause(rollout, f"paused by {actor_name(actor)}", actor=actor)
    return rollout


@audited("rollout.resume", _rollout_target, (RolloutError, PlanError))
def rollout_resume(*, rollout_id: int, actor: Actor) -> Rollout:
    rollout = _locked(rollout_id, "resume", [State.PAUSED], actor)
    # Judged afresh: what made it pause (too little data, a node down) may have passed.
    rollout.errors, rollout.last_verdict, rollout.last_measured_at = 0, "", None
    transition(rollout, State.PROGRESSING, "", event="resume", actor=actor)
    return rollout


@audited("rollout.promote", _rollout_target, (RolloutError, PlanError))
def rollout_promote(*, rollout_id: int, reason: str, actor: Actor) -> Rollout:
    """Skip the remaining steps and analysis; a reason is required, and recorded."""
    if not reason.strip():
        raise RolloutError("say why the analysis is skipped: a reason is required")
    rollout = _locked(
        rollout_id, "promote", [State.PENDING, State.PROGRESSING, State.PAUSED], actor
    )
    params = {"rollout_id": rollout_id, "reason": reason}
    second_person(actor, rollout.pool, "rollout.promote", params)
    transition(rollout, State.PROMOTING, f"promoted by {actor_name(actor)}: {reason}", actor=actor)
    return rollout


@audited("rollout.abort", _rollout_target, (RolloutError, PlanError))
def rollout_abort(*, rollout_id: int, actor: Actor, reason: str = "") -> Rollout:
    """Stop the rollout and take its canary back; one already going back is left to it (two
    people stopping the same bad canary at once both get what they asked for)."""
    rollout = _locked(rollout_id, "abort", Rollout.ACTIVE, actor)
    if rollout.state != State.ABORTING:
        why = f"aborted by {actor_name(actor)}" + (f": {reason}" if reason.strip() else "")
        _abort(rollout, why, actor)
    return rollout


def _abort(rollout: Rollout, why: str, actor: Actor) -> None:
    """A person's stop of `rollout`, refused in words (a 409, never a 500) only when what it
    goes back to cannot be served any more."""
    try:
        roll_back(rollout, why, actor=actor)
    except FleetError as exc:
        raise RolloutError(f"rollout #{rollout.pk} cannot go back: {exc}") from exc


@audited("rollout.roll_back", _rollout_target, (RolloutError, PlanError))
def rollout_roll_back(*, rollout_id: int, actor: Actor, reason: str) -> Rollout:
    """On-call's undo of a rollout under way: its canary aborted, the pool kept on the release
    the rollout started from. A rollback, so on-call's permission on the pool is enough; steering
    a rollout (pause, promote, abort) stays the release manager's."""
    found = Rollout.objects.select_related("pool").filter(pk=rollout_id).first()
    if found is None:
        raise RolloutError(f"there is no rollout #{rollout_id}")
    authorize(actor, "rollouts.rollback_release", found.pool)
    rollout = _locked(rollout_id, "roll back", Rollout.ACTIVE, None)  # authorized above
    if rollout.state != State.ABORTING:
        _abort(rollout, f"rolled back by {actor_name(actor)}: {reason}", actor)
    return rollout


@audited("rollout.retry", _rollout_target, (RolloutError, PlanError))
def rollout_retry(*, rollout_id: int, actor: Actor) -> Rollout:
    """A new rollout with the same canary, plan and analysis, and the very template version
    that analysis came from (terminal states stay terminal)."""
    rollout = _locked(rollout_id, "retry", [State.FAILED, State.ROLLED_BACK], actor)
    what = {
        "rollout_id": rollout.pk,
        "model": rollout.model.name,
        "pool": rollout.pool.name,
        "canary": rollout.canary_version,
        "plan": rollout.plan,
        "analysis": rollout.analysis,
        "lockstep": rollout.lockstep,
        "strategy": rollout.strategy,
    }
    second_person(actor, rollout.pool, "rollout.retry", what)
    with transaction.atomic():
        again = rollout_start(
            model_name=rollout.model.name,
            pool_name=rollout.pool.name,
            canary_version=rollout.canary_version,
            plan=rollout.plan,
            analysis=rollout.analysis,
            actor=actor,
            lockstep=[(m["model"], m["canary"]) for m in rollout.lockstep],
            strategy=rollout.strategy,
            quality_sets=rollout.quality_sets or None,
        )
        again.template = rollout.template
        again.save(update_fields=["template"])
    audit_record(
        actor=actor,
        target=f"rollout:{rollout.pk}:{rollout.model.name}",
        after={"rollout": again.pk},
    )
    return again


@audited("release.rollback", pool_target, (RolloutError, PlanError))
def release_rollback(*, model_name: str, pool_name: str, actor: Actor, reason: str = "") -> int:
    """On-call's one click: the pool back to its last good release, now, alone even on a
    protected pool (a move back never waits for a second person). Returns the version."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.rollback_release", pool)
    version = last_good_version(model, pool)
    if version is None:
        raise RolloutError(f"{model_name} on {pool_name} has no earlier good release")
    return _switch(model, pool, version, "rollback", actor, reason)


@audited("release.fallback", pool_target, (RolloutError, PlanError))
def release_fallback(*, model_name: str, pool_name: str, actor: Actor, reason: str = "") -> int:
    """The pool onto the model's pre-registered degraded version (a latency emergency), alone
    even on a protected pool."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.rollback_release", pool)
    if model.fallback_version is None:
        raise RolloutError(f"{model_name} has no fallback version; set one on the model page")
    return _switch(model, pool, model.fallback_version, "fallback", actor, reason)


def _model_and_pool(model_name: str, pool_name: str) -> tuple[Model, NodePool]:
    model = Model.objects.filter(name=model_name).first()
    pool = NodePool.objects.filter(name=pool_name).first()
    if model is None or pool is None:
        raise RolloutError(f"no {'model ' + model_name if model is None else 'pool ' + pool_name}")
    return model, pool


def _switch(
    model: Model, pool: NodePool, version: int, action: str, actor: Actor, reason: str
) -> int:
    """The whole pool onto `version` now: an active rollout is aborted and canary nodes drop
    their own deployments. A move back, so nothing of it waits for a second person."""
    current = Deployment.objects.filter(model=model, pool=pool).values_list("version", flat=True)
    before = current.first()
    if action == "rollback":
        Release.objects.filter(pool=pool, model=model, ended_at__isnull=True).update(
            rolled_back=True
        )
    with moving_back():
        try:
            deployment_set(model_name=model.name, version=version, pool=pool, actor=actor)
        except FleetError as exc:
            raise RolloutError(str(exc)) from exc
        running = active_rollout([model.name], pool)
        if running is not None and running.state != State.ABORTING:
            why = f"pool switched to v{version} ({action}) by {actor_name(actor)}"
            rollout = _locked(running.pk, "abort", Rollout.ACTIVE, None)  # authorized above
            _abort(rollout, why, actor)
        drop_node_deployments(model, pool, actor)
    audit_record(
        actor=actor,
        action=f"release.{action}",
        target=f"pool:{pool.name}:{model.name}",
        before={"version": before},
        after={"version": version},
        message=f"{action} by {actor_name(actor)}" + (f": {reason}" if reason.strip() else ""),
    )
    return version
