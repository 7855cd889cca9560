"""The ends of a release: promotion to the whole pool, the rollback of its canary nodes (by
itself, on a verdict, or as a person's abort asks), and the wait until every node is read back
serving what it must."""

from datetime import datetime, timedelta

from django.utils import timezone

from apps.accounts.permissions import moving_back
from apps.audit.services import Actor, actor_name, audit_record
from apps.fleet.desired import Want, Wanted, fleet_desired
from apps.fleet.errors import FleetError
from apps.fleet.memory import shortfalls
from apps.fleet.models import Deployment, NodePool
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.traffic.balancer import weights_reset, weights_set
from apps.prometheus.catalog import budget_queries
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.models import Model
from apps.rollouts.members import (
    Member,
    all_serve,
    changed_steps,
    members,
    pool_deployments,
    serves,
)
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Analysis
from apps.rollouts.transitions import ACTOR, State, transition
from apps.rollouts.verdicts import Verdict
from apps.web.clock import database_now


def promote(rollout: Rollout) -> None:
    """The pool moves to the canary, canary nodes drop their own deployments; done when every
    node is read back serving the canary (of every model released together) and, for the pool's
    rollback window, the baseline beside it, loaded but not served: an unversioned request goes
    to the highest version, and a rollback inside the window only narrows."""
    released = members(rollout)
    pooled = pool_deployments(rollout, released)
    moving = [
        m for m in released if (d := pooled.get(m.model.name)) is None or d.version != m.canary
    ]
    spec = Analysis.from_dict(rollout.analysis)
    watched = rollout.strategy == Rollout.Strategy.BLUE_GREEN and spec.switch_hold_s
    if moving:
        # A switch keeps the release before loaded while it is watched: going back then only
        # narrows, at once, on every node.
        window = max(rollout.pool.rollback_window_s, spec.switch_hold_s if watched else 0)
        if window and (short := _no_room_beside(rollout, moving)):
            window = 0
            audit_record(
                actor=ACTOR,
                action="rollout.skip_window",
                target=f"rollout:{rollout.pk}:{rollout.model.name}",
                message="the release before is not kept loaded for the rollback window, for "
                f"want of memory beside the new one: {'; '.join(short)}",
            )
        until = database_now() + timedelta(seconds=window)
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
    serving = {name: serves(d) for name, d in pooled.items()}
    switched = all_serve(rollout, serving)
    if switched is None:
        return None
    if watched:
        verdict, detail = after_switch(rollout, spec, switched, timezone.now())
        if verdict == Verdict.FAILURE:
            return roll_back(rollout, f"rolled back by itself after the switch: {detail}")
        if verdict != Verdict.SUCCESS:
            return _said(rollout, detail)
    weights_reset(rollout.pool, ACTOR)
    return transition(rollout, State.SUCCEEDED)


def after_switch(
    rollout: Rollout, spec: Analysis, since: datetime, now: datetime
) -> tuple[Verdict, str]:
    """What users got from every node since a blue-green switch (`since`): a failure as soon as
    its errors pass `error_delta` or its P99 the model's budget, with `min_requests` at least;
    a success once `switch_hold_s` passed so; inconclusive meanwhile, or while too few requests
    came (it waits for them: a release is never passed on too little)."""
    elapsed = int((now - since).total_seconds())
    nodes = list(rollout.pool.nodes.in_traffic().values_list("name", flat=True))
    if elapsed < 1 or not nodes:
        return Verdict.INCONCLUSIVE, "switched: watching users' requests"
    queries = budget_queries(
        model=rollout.model.name, steps=[], pool=rollout.pool.name, nodes=nodes, window_s=elapsed
    )
    try:
        found = {name: instant_query(queries[name]) for name in ("ok", "failed", "p99")}
    except PrometheusUnavailable as exc:
        return Verdict.INCONCLUSIVE, f"since the switch: {exc}"
    ok, failed, p99 = (rows[0][1] if rows else None for rows in found.values())
    requests = (ok or 0.0) + (failed or 0.0)
    if requests < spec.min_requests:
        return Verdict.INCONCLUSIVE, (
            f"{requests:.0f} requests in {elapsed} s since the switch, {spec.min_requests} "
            "needed to judge it: waiting for more"
        )
    errors, budget = (failed or 0.0) / requests, rollout.model.latency_budget_ms
    if errors > spec.error_delta:
        return Verdict.FAILURE, (
            f"{errors:.1%} of {requests:.0f} requests failed in {elapsed} s, at most "
            f"{spec.error_delta:.1%}"
        )
    if budget is not None and p99 is not None and p99 > budget:
        return Verdict.FAILURE, f"P99 {p99:.0f} ms in {elapsed} s, budget {budget} ms"
    if elapsed < spec.switch_hold_s:
        return Verdict.INCONCLUSIVE, (
            f"switched {elapsed} s ago, watched for {spec.switch_hold_s} s: {requests:.0f} "
            f"requests, {errors:.1%} failed"
        )
    return Verdict.SUCCESS, f"{requests:.0f} requests in {elapsed} s, {errors:.1%} failed"


def _said(rollout: Rollout, detail: str) -> None:
    """What a tick found while it watches, on the rollout's page, written only when it changed."""
    if rollout.reason != detail:
        rollout.reason = detail
        rollout.save(update_fields=["reason", "updated_at"])


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
    nodes = list(rollout.pool.nodes.serving())
    return shortfalls(rollout.pool, nodes, change, new_only=False)


def aborting(rollout: Rollout) -> None:
    released = members(rollout)
    for member in released:  # a step may have raced the abort
        drop_node_deployments(member.model, rollout.pool, ACTOR)
    pooled = pool_deployments(rollout, released)
    # What the pool's own deployment serves, the release before it too while its rollback window
    # lasts: a rollout started inside that window is rolled back to both, not to the first alone.
    targets = {
        m.model.name: serves(d) if (d := pooled.get(m.model.name)) else {m.baseline}
        for m in released
    }
    first = rollout.pool.nodes.serving().first()
    if rollout.strategy == Rollout.Strategy.BLUE_GREEN and first:  # its standby steps let go
        desired = fleet_desired(pool_ids=[rollout.pool.pk]).of(first)
        targets |= {c.model: set(desired[c.model].versions) for c in changed_steps(released[0])}
    done_at = all_serve(rollout, targets, timed=rollout.canary_nodes)
    if done_at is not None:
        rollout.rolled_back_at = done_at
        weights_reset(rollout.pool, ACTOR)
        transition(rollout, State.ROLLED_BACK)


def roll_back(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    """The rollout rolled back: by itself (the controller's verdict, a failed gate or switch), or
    as a person's abort asks. Canary nodes back to the pool's deployment, the baseline, which
    they still serve: only a narrowing. During a promotion the pool itself goes back to the
    baseline. On a pool whose balancer weighs nodes, the canary nodes first get no traffic
    (where others can take it) until the rollback is read back everywhere. A move back: never
    held for a second person on a protected pool."""
    # No request reaches the canary from now on, where other nodes can take them: a canary on
    # every node (a blue-green release's too) narrows in traffic instead.
    others = rollout.pool.nodes.exclude(name__in=rollout.canary_nodes).exists()
    if rollout.pool.traffic and others:
        weights_set(rollout.pool, dict.fromkeys(rollout.canary_nodes, 0), actor_name(actor))
    released = members(rollout)
    pooled = pool_deployments(rollout, released)
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
