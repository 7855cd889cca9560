"""Suspect changes: for an incident, every change in the hour before its onset, ranked by how
likely it caused the symptom. A change scores for its scope (the incident's model, its pool),
for how shortly it came before the onset, and for how much the model's P99, error ratio and (an
LLM's) time to first token moved across it; each suspect carries that evidence, and the pool and
model a rollback would switch back."""

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from apps.audit.actions import Kind, of_kind
from apps.audit.models import AuditEvent
from apps.fleet.models import Node
from apps.incidents.models import Incident
from apps.prometheus.catalog import step_for, suspect_queries
from apps.prometheus.client import PrometheusUnavailable, Series, range_query
from apps.rollouts.models import Rollout

LOOKBACK = timedelta(hours=1)
AROUND = timedelta(minutes=1)  # the P99 before a change is compared with the P99 after it
MAX_SUSPECTS = 10
# Changes of what the fleet serves, a rollout's course, people's requests to nodes and the
# registry's changes (a config or a status).
ACTIONS = of_kind(Kind.SERVING, Kind.ROLLOUT, Kind.REQUEST, Kind.REGISTRY)
ROLLOUTS = "system:rollouts"  # the rollout controller: its deployments are its rollout's steps


@dataclass
class Suspect:
    at: datetime
    action: str
    target: str
    model: str
    pool: str
    title: str
    score: float = 0.0
    evidence: list[str] = field(default_factory=list)
    p99: tuple[float, float] | None = None  # P99 (ms) before and after the change
    errors: tuple[float, float] | None = None  # error ratio before and after it
    ttft: tuple[float, float] | None = None  # an LLM's first token's P99 (ms) before and after
    parts: list[str] = field(default_factory=list)  # the changes folded into this one
    rollout: int = 0  # the rollout it is, if it is one

    @property
    def rollback(self) -> bool:
        """Whether one click can undo it: the pool back to its last good release."""
        return bool(self.model and self.pool)


def suspects(incident: Incident) -> tuple[list[Suspect], str]:
    """The ranked suspects, most likely first, and what went wrong reading Prometheus ("" when
    nothing did: the ranking then leaves the series out and says so)."""
    onset = incident.started_at
    events = AuditEvent.objects.filter(
        action__in=ACTIONS, result="ok", created_at__range=(onset - LOOKBACK, onset)
    ).order_by("-created_at", "-id")
    found = _group(list(events[: MAX_SUSPECTS * 5]))[:MAX_SUSPECTS]
    problem = ""
    try:
        _measure(found, onset)
    except PrometheusUnavailable as exc:
        problem = str(exc)
    model = incident.model.name if incident.model else ""
    pool = incident.pool.name if incident.pool else ""
    for suspect in found:
        _score(suspect, onset, model, pool)
    return sorted(found, key=lambda s: (-s.score, -s.at.timestamp())), problem


def _group(events: list[AuditEvent]) -> list[Suspect]:
    """One suspect per change, newest first: a rollout's events are one change (its latest step
    before the onset), and so are the deployments its controller made for it."""
    rollouts = {
        r.pk: r
        for r in Rollout.objects.filter(
            pk__in=[_number(e.target_name) for e in events if e.target_type == "rollout"]
        ).select_related("pool", "model")
    }
    names = {e.target_name for e in events if e.target_type == "node"}
    pools = dict(Node.objects.filter(name__in=names).values_list("name", "pool__name"))
    found: dict[tuple, Suspect] = {}
    rollout_of: dict[tuple[str, str], Suspect] = {}  # (model, pool): its rollout's suspect
    for event in events:  # newest first: the first seen of a change is its latest event
        kind, subject, model = event.target_type, event.target_name, event.target_model
        if kind == "rollout" and (rollout := rollouts.get(_number(subject))):
            key: tuple = ("rollout", rollout.pk)
            pool = rollout.pool.name
            title = f"rollout #{rollout.pk}: {rollout.moves} on {pool}"
        elif kind in ("pool", "node"):
            pool = subject if kind == "pool" else pools.get(subject, "")
            owner = rollout_of.get((model, pool))
            if event.actor == ROLLOUTS and owner is not None:
                owner.parts.append(f"{event.action} {event.target}")
                continue
            key, title = ("event", event.pk), f"{event.action} {event.target}"
        else:  # the registry's: a model, whichever pools run it
            pool = ""
            key, title = ("event", event.pk), f"{event.action} {event.target}"
        if key in found:
            found[key].parts.append(f"{event.action} at {event.created_at:%H:%M:%S}")
            continue
        rollout_id = key[1] if key[0] == "rollout" else 0
        suspect = Suspect(
            event.created_at, event.action, event.target, model, pool, title, rollout=rollout_id
        )
        found[key] = suspect
        if rollout_id:  # and what it released in lockstep with the model
            for name in rollouts[rollout_id].model_names:
                rollout_of.setdefault((name, pool), suspect)
    return list(found.values())


def _number(name: str) -> int:
    return int(name) if name.isdecimal() else 0


def _measure(found: list[Suspect], onset: datetime) -> None:
    """Each suspect's model P99, error ratio and time to first token (in its pool) just before
    and just after it: three range queries per model and pool, whatever the number of
    suspects."""
    if not found:
        return
    start = min(s.at for s in found) - AROUND
    end = onset + AROUND
    step = step_for((end - start).total_seconds())
    series: dict[tuple[str, str], dict[str, list[Series]]] = {}
    for suspect in found:
        if not suspect.model:
            continue
        pair = (suspect.model, suspect.pool)
        if pair not in series:
            queries = suspect_queries(model=suspect.model, pool=suspect.pool)
            series[pair] = {
                name: range_query(query, start=start, end=end, step_s=step)
                for name, query in queries.items()
            }
        after = min(suspect.at + AROUND, end)
        for name, found_series in series[pair].items():
            before_value = _median(found_series, suspect.at - AROUND, suspect.at)
            after_value = _median(found_series, suspect.at, after)
            if before_value is not None and after_value is not None:
                setattr(suspect, name, (before_value, after_value))


def _median(found: list[Series], start: datetime, end: datetime) -> float | None:
    """The worst series' median over [start, end): the P99 bound a user saw, one outlier
    (a cold start's first requests) left out."""
    medians = []
    for one in found:
        values = sorted(
            v
            for t, v in zip(one.times, one.values, strict=True)
            if v is not None and start.timestamp() <= t < end.timestamp()
        )
        if values:
            medians.append(values[len(values) // 2])
    return max(medians, default=None)


def _score(suspect: Suspect, onset: datetime, model: str, pool: str) -> None:
    lead = (onset - suspect.at).total_seconds()
    time = 1 / (1 + lead / 600)  # ten minutes before the onset: half as likely
    scope = 1.0
    if model:
        scope *= 3 if suspect.model == model else 0.5
    if pool:
        scope *= 2 if suspect.pool == pool else (1 if not suspect.pool else 0.5)
    shift = 1.0
    evidence = []
    if model and suspect.model == model:
        evidence.append(f"changes {model}, the model alerting")
    if pool and suspect.pool == pool:
        evidence.append(f"in pool {pool}, where it alerts")
    evidence.append(f"{_duration(lead)} before the onset")
    for name, moved in (("P99", suspect.p99), ("time to first token P99", suspect.ttft)):
        if moved is not None:  # each doubling counts once more
            before, after = moved
            ratio = after / before if before > 0 else 1.0
            shift *= 1 + max(0.0, math.log2(max(ratio, 1e-9)))
            evidence.append(f"{name} {before:.0f} ms → {after:.0f} ms across it (x{ratio:.2f})")
    if suspect.errors is not None:
        before, after = suspect.errors
        shift *= 1 + 20 * max(0.0, after - before)  # 5 more failures in 100 count as a doubling
        if after > before:
            evidence.append(f"errors {before:.1%} → {after:.1%} of requests across it")
    suspect.score = round(scope * time * shift, 3)
    suspect.evidence = evidence


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"
