"""The ends of a release: promotion to the whole pool, and the rollback of its canary nodes,
each done once every node is read back serving what it must."""

from datetime import timedelta

from django.utils import timezone

from apps.audit.services import audit_record
from apps.fleet.desired import Want, Wanted, fleet_desired
from apps.fleet.errors import FleetError
from apps.fleet.memory import shortfalls
from apps.fleet.services.deployments import deployment_set
from apps.fleet.traffic.balancer import weights_reset
from apps.rollouts.gates import (
    ACTOR,
)
from apps.rollouts.models import Rollout
from apps.rollouts.transitions import (
    Member,
    State,
    all_serve,
    changed_steps,
    drop_node_deployments,
    members,
    pool_deployments,
    serves,
    transition,
)


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
    if moving:
        window = rollout.pool.rollback_window_s
        if window and (short := _no_room_beside(rollout, moving)):
            window = 0
            audit_record(
                actor=ACTOR,
                action="rollout.skip_window",
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
    serving = {name: serves(d) for name, d in pooled.items()}
    if all_serve(rollout, serving) is not None:
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
    nodes = list(rollout.pool.nodes.serving())
    return shortfalls(nodes, fleet_desired(pool_ids=[rollout.pool.pk]), change, new_only=False)


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
