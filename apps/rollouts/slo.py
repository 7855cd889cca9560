"""SLO burn-rate gates, multi-window and multi-burn-rate as the SRE workbook's alerting chapter
has them. A model may declare what share of its requests must succeed (availability) and what
share must be answered within its latency budget (latency). The error budget is the rest; the
burn rate is how many times faster than sustainable a window spends it (a burn rate of 1 spends
exactly the budget). A step fails when the canary burns faster than the limit over both the short
window (it is still happening) and the long one (it is not a blip); over one of them only, it is
marginal.

Availability is counted from Triton's request counters. Triton has no latency histogram, only a
summary (quantiles 0.5, 0.9, 0.95, 0.99, 0.999), so the share of requests over the budget is
interpolated between its quantiles, each averaged over the window."""

import math
from dataclasses import dataclass

from apps.registry.models import Model
from apps.rollouts.verdicts import Verdict


@dataclass(frozen=True)
class Objectives:
    availability: float | None  # 0.999: 99.9 % of requests succeed
    latency: float | None  # 0.99: 99 % are answered within budget_ms
    budget_ms: int | None
    ttft: float | None = None  # an LLM's: 0.99: 99 % of first tokens within ttft_ms
    ttft_ms: int | None = None

    @classmethod
    def of(cls, model: Model) -> "Objectives | None":
        if model.slo_availability is None and model.slo_latency is None and not model.slo_ttft:
            return None
        latency = model.slo_latency if model.latency_budget_ms else None  # nothing to hold it to
        return cls(
            model.slo_availability,
            latency,
            model.latency_budget_ms,
            model.slo_ttft,
            model.slo_ttft_ms,
        )


def over_budget(quantiles: dict[float, float], budget: float) -> float | None:
    """The share of requests slower than `budget`, from a summary's {quantile: value}: linear
    between two quantiles, 0 above the highest one (at most 1 - that quantile, in truth), and
    from the origin below the lowest. None without a finite value."""
    points = sorted((q, v) for q, v in quantiles.items() if math.isfinite(v))
    if not points:
        return None
    within = [i for i, (_, v) in enumerate(points) if v <= budget]
    if not within:
        q, v = points[0]
        return 1 - q * budget / v if v > 0 else 1.0
    i = within[-1]
    if i == len(points) - 1:
        return 0.0
    (q1, v1), (q2, v2) = points[i], points[i + 1]
    return 1 - (q1 + (q2 - q1) * (budget - v1) / (v2 - v1))


def over_threshold(buckets: dict[float, float], threshold: float) -> float | None:
    """The share of observations above `threshold`, from a histogram's cumulative {bound: count}
    (+Inf the total): linear within the bucket that holds the threshold, as histogram_quantile
    is. None without any observation."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    below, below_count = 0.0, 0.0
    for bound, count in sorted(buckets.items()):
        if bound >= threshold:
            if math.isinf(bound):
                return 1 - below_count / total  # past the last bound: none known within
            within = below_count + (count - below_count) * (threshold - below) / (bound - below)
            return 1 - within / total
        below, below_count = bound, count
    return 1 - below_count / total


def burn_rate(bad: float | None, objective: float) -> float | None:
    """How many times the sustainable rate a window with `bad` share of bad requests spends the
    error budget at."""
    return None if bad is None else bad / (1 - objective)


@dataclass(frozen=True)
class Gate:
    verdict: Verdict
    detail: str


def gate(burns: dict[int, float | None], limit: float, objective: float, what: str) -> Gate:
    """The verdict from the burn rate over each window (seconds: burn rate)."""
    if any(burn is None for burn in burns.values()):
        missing = [f"{w} s" for w, burn in burns.items() if burn is None]
        return Gate(Verdict.INCONCLUSIVE, f"no {what} data over {' and '.join(missing)}")
    over = [w for w, burn in burns.items() if burn is not None and burn > limit]
    if not over:
        return Gate(Verdict.SUCCESS, "")
    rates = " and ".join(f"{burn:.3g}x over {w} s" for w, burn in burns.items())
    detail = f"{what} burn rate {rates} (limit {limit:g}x, objective {objective:.4g})"
    if len(over) == len(burns):
        return Gate(Verdict.FAILURE, detail)
    return Gate(
        Verdict.MARGINAL, f"{detail}: over the {' s and '.join(map(str, over))} s window only"
    )
