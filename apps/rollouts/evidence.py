"""The evidence a rollout makes where it lacks its own: synthetic requests from its evaluation
set, sent to the side of the comparison that served too few for the judge, and the round's
request counts labelled with them."""

import logging
from datetime import datetime, timedelta

from apps.quality.errors import QualityError
from apps.quality.models import SyntheticLoad
from apps.quality.services import synthetic_load_start
from apps.rollouts.gate import pinned_set
from apps.rollouts.members import Scope
from apps.rollouts.models import Rollout, Round
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind
from apps.rollouts.transitions import ACTOR

log = logging.getLogger(__name__)


def drive_evidence(rollout: Rollout, spec: Analysis, where: Scope, now: datetime) -> None:
    """Once a round finds a side with fewer requests than the judge needs, the evaluation set's
    inputs go to that side's nodes at `synthetic_rps`, a window and two intervals at a time,
    for the rest of the step: the judge gets its evidence instead of guessing, and the step's
    measurements say which requests were made (`labelled`)."""
    load = rollout.synthetic_load
    if not spec.synthetic_rps or (load is not None and _covers(load, now, spec.interval_s)):
        return
    names = load.nodes if load is not None else _short_sides(rollout, spec, where)
    if not names:
        return
    found = pinned_set(rollout, rollout.model.name)
    if found is None:
        return  # its absence pauses the gate, and rounds say why they are inconclusive
    seconds = spec.window_s + 2 * spec.interval_s
    try:
        rollout.synthetic_load = synthetic_load_start(
            set_id=found.pk,
            nodes=[n for n in where.nodes if n.name in names],
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


def _short_sides(rollout: Rollout, spec: Analysis, where: Scope) -> list[str]:
    """The nodes of each side that served fewer than `min_requests` in the step's last round
    that counted them (any model released together)."""
    last = rollout.rounds.filter(
        step=rollout.step, kind=Round.Kind.ANALYSIS, measurements__kind=Kind.REQUESTS
    ).first()
    if last is None:
        return []
    counts = list(last.measurements.filter(kind=Kind.REQUESTS))
    short = []
    if any(c.canary_value is not None and c.canary_value < spec.min_requests for c in counts):
        short += [n.name for n in where.canary]
    if any(c.baseline_value is not None and c.baseline_value < spec.min_requests for c in counts):
        short += [n.name for n in where.nodes if n not in where.canary]
    return short


def filling(rollout: Rollout, spec: Analysis, now: datetime) -> bool:
    """Whether synthetic requests began less than a window (and a round) ago: the window the
    judge reads is not full of them yet."""
    load = rollout.synthetic_load
    if load is None:
        return False
    began = (
        rollout.measurements.filter(
            step=rollout.step, kind=Kind.REQUESTS, evidence__has_key="synthetic"
        )
        .order_by("taken_at", "id")
        .values_list("taken_at", flat=True)
        .first()
    ) or load.created_at
    return (now - began).total_seconds() < spec.window_s + spec.interval_s
