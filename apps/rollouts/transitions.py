"""A rollout's record: each transition saved, audited and told (a webhook message), each round
written as a row of its step with its measurements, and the pool's release owned by the rollout
from its start to its end."""

from django.conf import settings
from django.utils import timezone

from apps.audit.services import Actor, audit_record
from apps.fleet.models import PoolOwner
from apps.fleet.owners import owner_claim, owner_let_go
from apps.rollouts.members import members
from apps.rollouts.models import Measurement, Notification, Rollout, Round
from apps.rollouts.notify import send, slack_text
from apps.rollouts.plans import parse_plan
from apps.rollouts.results import Result
from apps.rollouts.verdicts import Verdict

State = Rollout.State
ACTOR = "system:rollouts"  # the controller's name in the trail
EVENTS = {
    "started": "started: v{baseline} → v{canary}, {share} first",
    "step": "moved to step {step}: v{canary} on {share}",
    "paused": "paused: {reason}",
    "promoting": "passed its analysis; promoting v{canary} to the whole pool",
    "succeeded": "succeeded: {pool} serves v{canary}",
    "aborting": "is rolling back to v{baseline}: {reason}",
    "rolled_back": "rolled back: {pool} serves v{baseline} again",
    "failed": "failed: {reason}",
}


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


def notify(rollout: Rollout, event: str) -> Notification | None:
    template = EVENTS.get(event)
    if template is None or not settings.ROLLOUT_WEBHOOK_URL:
        return None
    link = f"{settings.SITE_URL}/rollouts/{rollout.pk}/"
    step = parse_plan(rollout.plan)[rollout.step]
    pool, model = slack_text(rollout.pool.name), slack_text(rollout.model.name)
    what = template.format(
        step=rollout.step + 1,
        canary=rollout.canary_version,
        baseline=rollout.baseline_version,
        share=slack_text(step.share),
        pool=pool,
        reason=slack_text(rollout.reason),
    )
    title = f"Rollout #{rollout.pk} of {model} on {pool}"
    about = {"rollout": {"id": rollout.pk, "state": rollout.state, "event": event, "url": link}}
    return send(title, what, link, event, about, rollout)


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


def record(
    rollout: Rollout, results: list[Result], verdict: str, kind: str = Round.Kind.ANALYSIS
) -> Round:
    """A round of the rollout's step, with its verdict, and its measurements."""
    number = rollout.rounds.filter(step=rollout.step).count() + 1
    judged = Round.objects.create(
        rollout=rollout, step=rollout.step, number=number, kind=kind, verdict=verdict
    )
    Measurement.objects.bulk_create(
        Measurement(
            rollout=rollout,
            round=judged,
            step=rollout.step,
            kind=r.kind,
            metric=r.name,
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
    return judged


def last_round_details(rollout: Rollout) -> str:
    """What the step's last analysis round found, once per distinct finding, in the order it
    measured them (its request counts first)."""
    last = rollout.rounds.filter(step=rollout.step, kind=Round.Kind.ANALYSIS).first()
    found = last.measurements.exclude(verdict=Verdict.SUCCESS).order_by("id") if last else []
    details = dict.fromkeys(m.detail for m in found if m.detail)
    return "; ".join(details) or "no data"
