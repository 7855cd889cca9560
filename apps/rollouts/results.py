"""What a round finds, measurement by measurement: its kind, the query as sent, both sides'
values, what they were judged against, the verdict with its reasons."""

from dataclasses import dataclass, field

from apps.rollouts.models import Measurement
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
