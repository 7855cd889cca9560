"""The rollout's lifecycle, advanced by a periodic task. One tick takes the rollout's row lock,
does at most one transition and saves it; everything it needs is in the database, so any process
may be killed at any point and the next tick carries on without repeating a step.

    pending -> progressing (step i) <-> paused -> promoting -> succeeded
    (any active state) -> aborting -> rolled_back;  failed when the fleet cannot do what it must.

A step, in order (`_forward`): its share goes out (steps), its canary is read back READY, the
first step's canary passes the gate before traffic (gate), synthetic requests fill what the
judge lacks (evidence), rounds are measured and judged (rounds), and once held it is done: the
next step, or the promotion (ending). A blue-green release has a course of its own (bluegreen).
"""

import logging
from collections.abc import Callable

from django.db import transaction
from django.utils import timezone

from apps.fleet.models import Node
from apps.rollouts.bluegreen import blue_green
from apps.rollouts.ending import aborting, promote
from apps.rollouts.evidence import drive_evidence
from apps.rollouts.gate import gate, gate_pending
from apps.rollouts.members import scope
from apps.rollouts.models import Rollout
from apps.rollouts.perf_gate import perf_under_way
from apps.rollouts.plans import Analysis
from apps.rollouts.rounds import Measured, judged, measure_ahead
from apps.rollouts.steps import apply_share, canary_ready, step_begin, step_done
from apps.rollouts.transitions import State, pause, transition

log = logging.getLogger(__name__)

TICK_ERROR_LIMIT = 3


def rollout_advance(*, rollout_id: int) -> None:
    try:
        # Prometheus may take its whole timeout to answer: measured before the row lock, so a
        # person's pause or abort never waits behind it; used only if nothing moved meanwhile.
        reading = measure_ahead(rollout_id)
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


def _forward(rollout: Rollout, reading: Measured | None = None) -> None:
    """A pending or progressing rollout, one step at a time."""
    if rollout.strategy == Rollout.Strategy.BLUE_GREEN:
        return blue_green(rollout)
    spec, where, now = Analysis.from_dict(rollout.analysis), scope(rollout), timezone.now()
    if not where.nodes:
        return pause(rollout, f"pool {rollout.pool.name} has no nodes")
    if rollout.step_started_at is None:
        return step_begin(rollout, where, now)
    down = [n.name for n in where.nodes if n.health == Node.Health.UNREACHABLE]
    if down:
        return pause(rollout, f"node {', '.join(down)} is unreachable; resume when it is back")
    if rollout.step_ready_at is None:
        # Once the performance gate measures, its node switches between the two versions: it
        # was read back READY, and is not a canary stalled meanwhile.
        measuring = spec.perf_concurrency and perf_under_way(rollout)
        if not measuring and not canary_ready(rollout, where, spec, now):
            return None
        if gate_pending(rollout):
            if not gate(rollout, where, spec, now):
                return None
            apply_share(rollout, where)  # passed: now with the step's share of requests
        rollout.step_ready_at = now
        return rollout.save()
    drive_evidence(rollout, spec, where, now)
    if not judged(rollout, spec, reading, where, now):
        return None
    if not step_done(rollout, where.step, spec, now):
        return None
    if where.last:
        return transition(rollout, State.PROMOTING)
    rollout.step += 1
    return step_begin(rollout, scope(rollout), now)  # the next share goes out in this same tick


# Each handler gets what was measured before the lock; only a rollout going forward measures.
HANDLERS: dict[str, Callable[[Rollout, Measured | None], None]] = {
    State.PENDING: _forward,
    State.PROGRESSING: _forward,
    State.PROMOTING: lambda rollout, _: promote(rollout),
    State.ABORTING: lambda rollout, _: aborting(rollout),
}
