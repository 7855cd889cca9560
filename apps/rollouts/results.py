"""What a round finds, measurement by measurement (its kind, the query as sent, both sides'
values, what they were judged against, the verdict with its reasons), and the round written as
a row of the rollout's step with its measurements."""

from dataclasses import dataclass, field, replace

from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.verdicts import Verdict

Kind = Measurement.Kind


@dataclass(frozen=True)
class Result:
    metric: str
    query: str
    canary: float | None
    baseline: float | None
    threshold: float | None
    verdict: Verdict
    detail: str
    evidence: dict[str, object] = field(default_factory=dict)
    kind: Kind = field(kw_only=True)
    member: str = field(default="", kw_only=True)  # a model released in lockstep with the lead

    @property
    def name(self) -> str:
        """The metric as people read it: a lockstep member's carries the member's name."""
        return f"{self.member}: {self.metric}" if self.member else self.metric


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


def labelled(rollout: Rollout, results: list[Result]) -> list[Result]:
    """The round's request counts of the rollout's own model, saying which of them the rollout
    made."""
    load = rollout.synthetic_load
    if load is None:
        return results
    note = (
        f"{load.rps:g} synthetic requests/s from {load.evaluation_set} to "
        f"{', '.join(load.nodes)} since {load.created_at:%H:%M:%S}"
    )
    made = {"load": load.pk, "rps": load.rps, "nodes": load.nodes, "sent": load.sent}
    return [
        replace(
            r,
            detail="; ".join(filter(None, [r.detail, note])),
            evidence=r.evidence | {"synthetic": made},
        )
        if r.kind == Kind.REQUESTS and not r.member  # the lead's: the requests made are to it
        else r
        for r in results
    ]
