"""A rollout's state: each transition saved, audited and told (a webhook message), and the
pool's release owned by the rollout from its start to its end."""

from django.utils import timezone

from apps.audit.services import Actor, audit_record
from apps.fleet.models import PoolOwner
from apps.fleet.owners import owner_claim, owner_let_go
from apps.rollouts.members import members
from apps.rollouts.models import Rollout
from apps.rollouts.notify import notify

State = Rollout.State
ACTOR = "system:rollouts"  # the controller's name in the trail


def transition(
    rollout: Rollout, state: str, reason: str = "", event: str = "", actor: Actor = ACTOR
) -> None:
    """Save the new state, with one audit event and a webhook message."""
    before = rollout.state
    rollout.state = state
    rollout.reason = reason or rollout.reason
    if state in Rollout.TERMINAL:
        rollout.finished_at = timezone.now()
        for member in members(rollout):  # the pool's release is the reconciler's again
            owner_let_go(pool=rollout.pool, model=member.model, ref=owner_ref(rollout))
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


def owner_ref(rollout: Rollout) -> str:
    """How a rollout names itself as the owner of what its pool serves (fleet.PoolOwner)."""
    return f"rollout:{rollout.pk}"


def pool_claim(rollout: Rollout, by: str) -> PoolOwner | None:
    """The rollout owns what its pool serves of each model it releases, until it ends; returns
    the owner that holds one of them instead (on-call's pin on a degradation tier)."""
    why = (
        f"rollout #{rollout.pk} of {rollout.moves} on {rollout.pool.name} holds it: abort it, "
        "or roll the pool back, before changing the release by hand"
    )
    for member in members(rollout):
        if held := owner_claim(
            pool=rollout.pool,
            model=member.model,
            kind=PoolOwner.Kind.ROLLOUT,
            ref=owner_ref(rollout),
            why=why,
            by=by,
        ):
            return held
    return None


def pause(rollout: Rollout, reason: str, actor: Actor = ACTOR) -> None:
    transition(rollout, State.PAUSED, reason, actor=actor)
