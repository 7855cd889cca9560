"""The statistical judge: canary against baseline on samples, not single values, as Kayenta
judges. Each metric's per-interval samples (say, every 5 s of every node's mean latency) on both
sides are compared with a one-sided Mann-Whitney U test (is the canary worse?) and an effect size
(how much worse, its median against the baseline's, or its mean minus the baseline's):

- fail: significantly worse (p below 1 - confidence) *and* worse beyond the metric's tolerance;
- marginal: one of the two (a real but tolerable difference, or a large but unproven one);
- pass: neither; inconclusive: too few samples on a side to say.

A step fails when any metric fails; otherwise its score is the weighted share of the metrics that
pass, a success from `pass_score` up, marginal below. An LLM step's first tokens are compared
within buckets of prompt length (`by_prompt`, `compare_within`), and its KV cache guarded
(`kv_guard`), from what Prometheus answered."""

import math
import statistics
from dataclasses import dataclass

from scipy.stats import mannwhitneyu, norm, rankdata

from apps.prometheus.client import Series
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind, Result
from apps.rollouts.verdicts import Verdict

MIN_SAMPLES = 3


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    canary: list[float]
    baseline: list[float]
    u: float | None = None
    p: float | None = None
    effect: float | None = None  # relative (0.1: 10 % worse) or absolute, as judged
    detail: str = ""

    def evidence(self) -> dict[str, object]:
        """What a measurement keeps, to be shown and checked later."""
        return {
            "canary": self.canary,
            "baseline": self.baseline,
            "u": self.u,
            "p": self.p,
            "effect": self.effect,
            "verdict": self.verdict,
        }


def compare(
    canary: list[float],
    baseline: list[float],
    *,
    confidence: float,
    tolerance: float,
    relative: bool,
    margin: float = 0.0,
) -> Comparison:
    """Higher is worse. `relative`: the effect is the canary's median over the baseline's, less
    one; else the difference of their means (for ratios that are mostly 0, such as errors). A
    relative effect counts only when the medians are also more than `margin` apart: 10 % of a
    3 ms latency is noise."""
    c = [x for x in canary if math.isfinite(x)]
    b = [x for x in baseline if math.isfinite(x)]
    if len(c) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
        why = f"{len(c)} canary and {len(b)} baseline samples; {MIN_SAMPLES} a side are needed"
        return Comparison(Verdict.INCONCLUSIVE, c, b, detail=why)
    effect = _effect(c, b, relative)
    if len(set(c) | set(b)) == 1:  # all equal: no test can tell them apart
        u, p = len(c) * len(b) / 2, 1.0
    else:
        result = mannwhitneyu(c, b, alternative="greater")
        u, p = float(result.statistic), float(result.pvalue)
    apart = not relative or statistics.median(c) - statistics.median(b) > margin
    worse, beyond = p < 1 - confidence, effect > tolerance and apart
    verdict = (
        Verdict.FAILURE
        if worse and beyond
        else Verdict.MARGINAL
        if worse or beyond
        else Verdict.SUCCESS
    )
    how = f"{effect:+.1%}" if relative else f"{effect:+.4g}"
    allowed = f"tolerance {tolerance:g}" + (f", margin {margin:g}" if relative and margin else "")
    detail = f"canary {how} against the baseline ({allowed}), p={p:.3g}"
    return Comparison(verdict, c, b, u, p, effect, "" if verdict == Verdict.SUCCESS else detail)


def compare_within(
    strata: list[tuple[list[float], list[float]]],
    *,
    confidence: float,
    tolerance: float,
    margin: float = 0.0,
) -> Comparison:
    """`compare` (relative) within strata, say prompt-length buckets, so that a canary that
    happened to get more of a slow stratum is not judged for it: van Elteren's stratified rank
    sum (each stratum's canary rank sum weighted by 1 / (its samples + 1), normal approximation),
    and the effect each stratum's median ratio, weighted by its samples. A stratum without a
    sample on either side says nothing."""
    kept = [
        (c, b)
        for c, b in (
            ([x for x in cs if math.isfinite(x)], [x for x in bs if math.isfinite(x)])
            for cs, bs in strata
        )
        if c and b
    ]
    c_all, b_all = [x for c, _ in kept for x in c], [x for _, b in kept for x in b]
    if len(c_all) < MIN_SAMPLES or len(b_all) < MIN_SAMPLES:
        why = (
            f"{len(c_all)} canary and {len(b_all)} baseline samples in the same buckets; "
            f"{MIN_SAMPLES} a side are needed"
        )
        return Comparison(Verdict.INCONCLUSIVE, c_all, b_all, detail=why)
    t = expected = variance = 0.0
    for c, b in kept:
        n = len(c) + len(b)
        rank_sum = float(sum(rankdata(c + b)[: len(c)]))
        t += rank_sum / (n + 1)
        expected += len(c) / 2
        variance += len(c) * len(b) / (12 * (n + 1))
    p = float(norm.sf((t - expected) / math.sqrt(variance)))
    weights = [len(c) + len(b) for c, b in kept]
    effect = sum(w * _effect(c, b, True) for w, (c, b) in zip(weights, kept, strict=True))
    effect /= sum(weights)
    apart = sum(
        w * (statistics.median(c) - statistics.median(b))
        for w, (c, b) in zip(weights, kept, strict=True)
    ) / sum(weights)
    worse, beyond = p < 1 - confidence, effect > tolerance and apart > margin
    verdict = (
        Verdict.FAILURE
        if worse and beyond
        else Verdict.MARGINAL
        if worse or beyond
        else Verdict.SUCCESS
    )
    allowed = f"tolerance {tolerance:g}" + (f", margin {margin:g}" if margin else "")
    detail = (
        f"canary {effect:+.1%} against the baseline within {len(kept)} buckets ({allowed}), "
        f"p={p:.3g}"
    )
    return Comparison(
        verdict, c_all, b_all, t, p, effect, "" if verdict == Verdict.SUCCESS else detail
    )


def _effect(canary: list[float], baseline: list[float], relative: bool) -> float:
    if not relative:
        return statistics.fmean(canary) - statistics.fmean(baseline)
    c, b = statistics.median(canary), statistics.median(baseline)
    if b == 0:
        return 0.0 if c == 0 else math.inf
    return c / b - 1


def score(verdicts: list[tuple[Verdict, float]], pass_score: float) -> Verdict:
    """The step's verdict from each metric's (verdict, weight)."""
    judged = [(v, w) for v, w in verdicts if v != Verdict.INCONCLUSIVE]
    if any(v == Verdict.FAILURE for v, _ in judged):
        return Verdict.FAILURE
    if not judged:
        return Verdict.INCONCLUSIVE
    passed = sum(w for v, w in judged if v == Verdict.SUCCESS) / sum(w for _, w in judged)
    return Verdict.SUCCESS if passed >= pass_score else Verdict.MARGINAL


# An LLM step's own checks, beside its samples ---------------------------------------------

PROMPT_BUCKETS = 3  # prompt-length buckets a first token's samples are compared within


def by_prompt(
    series: list[Series], prompts: list[Series], canary: set[str]
) -> list[tuple[list[float], list[float]]]:
    """A first token's samples (`series`), canary and baseline, in PROMPT_BUCKETS buckets of
    the prompt length each sample's requests had on its node at that time (`prompts`, read at
    the samples' own times; tertiles of them all): a canary that got longer prompts waits longer
    for its first token, and is not to be failed for it. Fewer than two buckets where the
    backend exports no prompt tokens, or all prompts were alike."""
    lengths = {
        (each.labels.get("node"), at): value
        for each in prompts
        for at, value in zip(each.times, each.values, strict=True)
        if value is not None
    }
    if not lengths:
        return []
    points = [
        (lengths[key], node in canary, value)
        for each in series
        for at, value in zip(each.times, each.values, strict=True)
        if value is not None and (key := (node := each.labels.get("node"), at)) in lengths
    ]
    if not points:
        return []
    seen = sorted(length for length, _, _ in points)
    edges = sorted({seen[len(seen) * k // PROMPT_BUCKETS] for k in range(1, PROMPT_BUCKETS)})
    strata: dict[int, tuple[list[float], list[float]]] = {}
    for length, in_canary, value in points:
        bucket = sum(length >= edge for edge in edges)
        strata.setdefault(bucket, ([], []))[0 if in_canary else 1].append(value)
    return [strata[k] for k in sorted(strata)]


def kv_guard(
    query: str, used: dict[str, float], canary: set[str], spec: Analysis, compare: bool
) -> list[Result]:
    """The KV-cache guard on each node's share in use (`used`, as `query` read it), where the
    LLM's backend exports it: the canary's fullest node at `kv_cache_max` or past it fails,
    unless the baseline's is as full (the pool saturated, not the release: inconclusive). None
    where nothing exports it."""
    c = max((v for node, v in used.items() if node in canary), default=None)
    b = max((v for node, v in used.items() if node not in canary), default=None)
    if c is None:
        return []
    limit, b = spec.kv_cache_max, b if compare else None
    if c < limit:
        verdict, detail = Verdict.SUCCESS, f"canary's fullest node {c:.0%} used"
    elif b is not None and b >= limit:
        verdict = Verdict.INCONCLUSIVE
        detail = f"canary {c:.0%} and baseline {b:.0%} used: the pool is full, not the release"
    else:
        verdict = Verdict.FAILURE
        detail = f"canary's KV cache {c:.0%} used, at most {limit:.0%}: requests wait for memory"
    return [Result("KV-cache use", query, c, b, limit, verdict, detail, kind=Kind.KV_CACHE)]
