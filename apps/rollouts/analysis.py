"""Canary against baseline from Prometheus, with the same queries for both sides. Every
measurement keeps its PromQL, both values, threshold and verdict.

The model itself is compared by node: canary nodes against the nodes still on the baseline. An
unversioned request goes to the highest READY version, so a canary node's traffic is the canary's;
and Triton 2.51 labels an ensemble's own request metrics `version="1"` whatever version served them
(measured: tests/integration/test_rollouts.py), so the version label cannot tell an ensemble's
canary from its baseline. Step models do carry their real version: each step whose pinned version
differs between the two releases is compared by its `version` label (mean latency, held to the
same tolerance, and to the step's budget)."""

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from apps.prometheus.catalog import (
    canary_queries,
    custom_query,
    first_token_buckets,
    kv_cache_query,
    llm_sample_queries,
    nodes_matcher,
    prompt_sample_query,
    quantiles_query,
    sample_queries,
    step_mean_latency_query,
)
from apps.prometheus.client import (
    PrometheusUnavailable,
    instant_query,
    range_query,
)
from apps.rollouts.judge import by_prompt, compare, compare_within, kv_guard, score
from apps.rollouts.members import ChangedStep
from apps.rollouts.plans import Analysis, CustomMetric
from apps.rollouts.results import Kind, Result
from apps.rollouts.slo import Objectives, burn_rate, gate, over_budget, over_threshold
from apps.rollouts.verdicts import Verdict


def _by(label: str, query: str) -> dict[str, float]:
    return {
        labels[label]: value
        for labels, value in instant_query(query)
        if label in labels and not math.isnan(value)
    }


def measure(
    *,
    model: str,
    pool: str,
    canary_nodes: list[str],
    spec: Analysis,
    budget_ms: int | None,
    steps: list[ChangedStep],
    llm: str = "",
    compare: bool = True,
    slo: Objectives | None = None,
    canary_version: int | None = None,
    baseline_version: int | None = None,
    baseline_nodes: list[str] | None = None,
) -> list[Result]:
    """One round of analysis. `compare` is False when no node serves the baseline any more (a
    100% step): the canary is then held to the budget and the error allowance alone. A model
    with objectives is also held to them (`slo`), at every step. The analysis's own metrics
    are queried with each side's version and nodes (`baseline_nodes`: the pool's other nodes;
    by default those that served the model in the window). `llm`: the model whose series tell
    the first token and tokens, where not the model's own (a pipeline's streaming step).
    Raises PrometheusUnavailable."""
    text = canary_queries(model=model, pool=pool, window_s=spec.window_s)
    kv_query = kv_cache_query(model=llm or model, pool=pool)
    per_node = {name: _by("node", query) for name, query in text.items()}
    canary_set = set(canary_nodes)

    def side(name: str, canary: bool) -> list[float]:
        return [v for node, v in per_node[name].items() if (node in canary_set) == canary]

    def totals(canary: bool) -> tuple[float, float, float | None]:
        ok, failed, p99 = side("ok", canary), side("failed", canary), side("p99", canary)
        return sum(ok), sum(failed), max(p99) if p99 else None

    c_ok, c_failed, c_p99 = totals(True)
    b_ok, b_failed, b_p99 = totals(False) if compare else (0.0, 0.0, None)
    where = f"canary: {nodes_matcher(canary_nodes)}; baseline: the pool's other nodes"
    c_requests, b_requests = c_ok + c_failed, b_ok + b_failed
    short = [
        f"{name} served {round(n)}"
        for name, n, needed in [("canary", c_requests, True), ("baseline", b_requests, compare)]
        if needed and n < spec.min_requests
    ]
    enough = not short
    results = [
        Result(
            "requests",
            f"{text['ok']} + {text['failed']}\n# {where}",
            c_requests,
            b_requests if compare else None,
            spec.min_requests,
            Verdict.SUCCESS if enough else Verdict.INCONCLUSIVE,
            ""
            if enough
            else f"{' and '.join(short)} requests in the last {spec.window_s} s; "
            f"at least {spec.min_requests} each are needed",
            kind=Kind.REQUESTS,
        )
    ]
    if spec.judge == "statistical" and compare:
        results += _sampled(model, llm or model, pool, canary_set, spec, enough)
    else:
        c_errors = c_failed / c_requests if c_requests else None
        b_errors = b_failed / b_requests if b_requests else None
        # Without a baseline to compare with (a 100% step), the delta is the whole allowance.
        allowed = b_errors if compare else 0.0
        threshold = None if allowed is None else allowed + spec.error_delta
        results += [
            _judge(
                Kind.LATENCY,
                "p99",
                f"{text['p99']}\n# {where}",
                c_p99,
                b_p99,
                _p99_limit(b_p99, budget_ms, spec),
                enough,
                " ms",
                compare,
            ),
            _judge(
                Kind.ERRORS,
                "error_ratio",
                f"{text['failed']} / requests\n# {where}",
                c_errors,
                b_errors,
                threshold,
                enough,
                "",
                compare,
            ),
        ]
    results += kv_guard(kv_query, _by("node", kv_query), canary_set, spec, compare)
    for step in steps:
        query = step_mean_latency_query(step=step.model, pool=pool, window_s=spec.window_s)
        by_version = _by("version", query)
        c, b = by_version.get(str(step.canary)), by_version.get(str(step.baseline))
        label = f"mean latency {step.model} v{step.canary} vs v{step.baseline}"
        limit = _p99_limit(b if compare else None, step.budget_ms, spec)
        results.append(
            _judge(
                Kind.STEP, label, query, c, b if compare else None, limit, enough, " ms", compare
            )
        )
    if spec.metrics and baseline_nodes is None:
        served = per_node["ok"].keys() | per_node["failed"].keys()
        baseline_nodes = sorted(served - canary_set)
    for metric in spec.metrics:
        sides = {"canary": (canary_nodes, canary_version)}
        if compare:
            sides["baseline"] = (baseline_nodes or [], baseline_version)
        found = _custom(metric, pool, spec.window_s, sides, enough)
        results += [found] if found else []
    if slo is not None:
        results += _burn_rates(model, pool, canary_set, spec, slo, enough, per_node)
    return results


def _custom(
    metric: CustomMetric,
    pool: str,
    window_s: int,
    sides: dict[str, tuple[list[str], int | None]],
    enough: bool,
) -> Result | None:
    """One of the analysis's own metrics: the canary against the baseline and its bounds, or
    its bounds alone with no baseline left (`sides` without one): none then without bounds."""
    if "baseline" not in sides and metric.min is None and metric.max is None:
        return None
    queries = {
        side: custom_query(metric.query, pool=pool, nodes=nodes, version=version, window_s=window_s)
        for side, (nodes, version) in sides.items()
    }
    read = {side: _one_value(query) for side, query in queries.items()}
    canary, baseline = read["canary"][0], read.get("baseline", (None, ""))[0]
    better = "higher" if metric.higher_is_better else "lower"
    limit = None
    if baseline is not None:
        allowed = abs(baseline) * metric.tolerance
        limit = baseline - allowed if metric.higher_is_better else baseline + allowed
    # The row's threshold: the strictest limit on the worse side, else the other bound.
    near, far = (metric.min, metric.max) if metric.higher_is_better else (metric.max, metric.min)
    worse = [x for x in (limit, near) if x is not None]
    threshold = (max if metric.higher_is_better else min)(worse) if worse else far
    missing = [f"the {side} ({reason})" for side, (value, reason) in read.items() if value is None]
    why: list[str] = []
    if missing:
        verdict = Verdict.INCONCLUSIVE
        why.append(f"no data for {metric.name!r} from {' nor '.join(missing)} in the window")
    elif not enough:
        verdict = Verdict.INCONCLUSIVE
        why.append("too few requests to judge")
    else:
        assert canary is not None
        if limit is not None and (canary < limit if metric.higher_is_better else canary > limit):
            why.append(
                f"canary {canary:.4g} is worse than the baseline's {baseline:.4g} by more than "
                f"{metric.tolerance * 100:g}% ({better} is better; the limit is {limit:.4g})"
            )
        if metric.min is not None and canary < metric.min:
            why.append(f"canary {canary:.4g} is below the min {metric.min:g}")
        if metric.max is not None and canary > metric.max:
            why.append(f"canary {canary:.4g} is above the max {metric.max:g}")
        verdict = Verdict.FAILURE if why else Verdict.SUCCESS
    return Result(
        f"{metric.PREFIX}{metric.name}",
        "\n".join(f"{query}\n# {side}" for side, query in queries.items()),
        canary,
        baseline,
        threshold,
        verdict,
        "; ".join(why),
        kind=Kind.CUSTOM,
    )


def _one_value(query: str) -> tuple[float | None, str]:
    """The query's single value now, or None and why not."""
    rows = instant_query(query)
    if len(rows) > 1:
        return None, f"{len(rows)} series, not one: aggregate them (sum, avg, max)"
    if not rows:
        return None, "no series"
    value = rows[0][1]
    if not math.isfinite(value):  # 0/0 where a side served nothing that the series counts
        return None, f"its value is {'NaN' if math.isnan(value) else value}"
    return value, ""


def _p99_limit(baseline: float | None, budget_ms: int | None, spec: Analysis) -> float | None:
    """Canary <= baseline x (1 + tolerance) or baseline + margin, whichever is higher, and <= the
    budget when there is one."""
    relative = None
    if baseline is not None:
        relative = max(baseline * (1 + spec.p99_tolerance), baseline + spec.p99_margin_ms)
    found = [x for x in (relative, budget_ms) if x]
    return min(found) if found else None


def _judge(
    kind: Kind,
    metric: str,
    query: str,
    canary: float | None,
    baseline: float | None,
    threshold: float | None,
    enough: bool,
    unit: str,
    compare: bool,
) -> Result:
    if not enough:
        verdict, detail = Verdict.INCONCLUSIVE, "too few requests to judge"
    elif canary is None or (threshold is None and compare):
        missing = "canary" if canary is None else "baseline"
        verdict, detail = Verdict.INCONCLUSIVE, f"no {metric} for the {missing} in the window"
    elif threshold is None:  # every node runs the canary and there is no budget to hold it to
        verdict, detail = Verdict.SUCCESS, "no baseline left to compare with, and no budget"
    elif canary > threshold:
        verdict = Verdict.FAILURE
        detail = f"canary {canary:.4g}{unit} is above the threshold {threshold:.4g}{unit}"
    else:
        verdict, detail = Verdict.SUCCESS, ""
    return Result(metric, query, canary, baseline, threshold, verdict, detail, kind=kind)


def overall(results: list[Result], pass_score: float = 1.0) -> str:
    """A failure or too little data decides; else the share of metrics that pass."""
    verdicts = {r.verdict for r in results}
    for verdict in (Verdict.FAILURE, Verdict.INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return score([(r.verdict, 1.0) for r in results], pass_score)


def _sampled(
    model: str, speaker: str, pool: str, canary: set[str], spec: Analysis, enough: bool
) -> list[Result]:
    """The statistical judge's metrics: each node's per-interval samples over the window, the
    canary nodes' against the others'. An LLM's first token, time per token and answer length
    as well, from the series of the `speaker` (the model, or a pipeline's step that streams),
    where both sides export them: a release that moves to streaming has nothing to compare
    them with, and is judged on its whole requests."""
    end = timezone.now()
    start = end - timedelta(seconds=spec.window_s)
    llm = llm_sample_queries(model=speaker, pool=pool, step_s=spec.sample_s)
    prompts = prompt_sample_query(model=speaker, pool=pool, step_s=spec.sample_s)
    queries = sample_queries(model=model, pool=pool, step_s=spec.sample_s) | llm
    results = []
    for metric, query in queries.items():
        series = range_query(query, start=start, end=end, step_s=spec.sample_s)
        sides: dict[bool, list[float]] = {True: [], False: []}
        for each in series:
            values = [v for v in each.values if v is not None]
            sides[each.labels.get("node") in canary] += values
        if metric in llm and not (sides[True] and sides[False]):
            continue
        kind, tolerance, margin = JUDGED[metric](spec)
        strata = []
        if kind == Kind.TTFT:
            lengths = range_query(prompts, start=start, end=end, step_s=spec.sample_s)
            strata = by_prompt(series, lengths, canary)
        if len(strata) > 1:
            found = compare_within(
                strata, confidence=spec.confidence, tolerance=tolerance, margin=margin
            )
            query += f"\n# within buckets of the prompt's length: {prompts}"
        else:
            found = compare(
                sides[True],
                sides[False],
                confidence=spec.confidence,
                tolerance=tolerance,
                relative=kind != Kind.ERRORS,
                margin=margin,
            )
        verdict = found.verdict if enough else Verdict.INCONCLUSIVE
        results.append(
            Result(
                f"{metric} (samples)",
                f"{query}\n# every {spec.sample_s} s over the last {spec.window_s} s, by node",
                statistics.median(found.canary) if found.canary else None,
                statistics.median(found.baseline) if found.baseline else None,
                tolerance,
                verdict,
                found.detail if enough else "too few requests to judge",
                found.evidence(),
                kind=kind,
            )
        )
    return results


# Each sampled metric's kind, tolerance and margin (in its unit, relative effects only).
JUDGED: dict[str, Callable[[Analysis], tuple[Kind, float, float]]] = {
    "latency": lambda spec: (Kind.LATENCY, spec.latency_tolerance, spec.latency_margin_ms),
    "error_ratio": lambda spec: (Kind.ERRORS, spec.error_tolerance, 0.0),
    "time to first token": lambda spec: (Kind.TTFT, spec.llm_tolerance, spec.latency_margin_ms),
    "time per output token": lambda spec: (Kind.ITL, spec.llm_tolerance, 0.0),
    "output tokens per request": lambda spec: (Kind.TOKENS, spec.llm_tolerance, 0.0),
}


def _burn_rates(
    model: str,
    pool: str,
    canary: set[str],
    spec: Analysis,
    slo: Objectives,
    enough: bool,
    counted: dict[str, dict[str, float]],
) -> list[Result]:
    """The SLO gate: each declared objective's burn rate on the canary nodes over the short
    and the long window; beside it, for comparison, the other nodes' over the long one. The long
    window is the analysis window, whose requests by node `measure` has read (`counted`)."""
    windows = sorted({min(spec.slo_short_s, spec.window_s), spec.window_s})
    bad: dict[tuple[int, bool], dict[str, float | None]] = {}
    for window in windows:
        if window == spec.window_s:
            ok, failed = counted["ok"], counted["failed"]
        else:
            text = canary_queries(model=model, pool=pool, window_s=window)
            ok, failed = _by("node", text["ok"]), _by("node", text["failed"])
        quantiles: dict[str, dict[float, float]] = {}
        for labels, value in instant_query(
            quantiles_query(model=model, pool=pool, window_s=window)
        ):
            if "node" in labels and "quantile" in labels:
                quantiles.setdefault(labels["node"], {})[float(labels["quantile"])] = value
        for side in (True, False):
            nodes = {
                n for n in ok.keys() | failed.keys() | quantiles.keys() if (n in canary) == side
            }
            bad[window, side] = _bad_shares(nodes, ok, failed, quantiles, slo.budget_ms)
        if slo.ttft is not None and slo.ttft_ms:
            slow = _slow_first_tokens(model, pool, window, slo.ttft_ms, canary)
            for side in (True, False):
                bad[window, side]["first token"] = slow[side]
    long = windows[-1]
    what = " and ".join(f"{w} s" for w in windows)
    where = f"# canary nodes over {what}; the pool's other nodes over {long} s beside them"
    text = canary_queries(model=model, pool=pool, window_s=long)
    queries = {
        "availability": f"{text['failed']} / ({text['ok']} + {text['failed']})",
        "latency": f"{quantiles_query(model=model, pool=pool, window_s=long)}\n"
        f"# the share above {slo.budget_ms} ms, interpolated",
        "first token": "\n".join(
            q for _, q in first_token_buckets(model=model, pool=pool, window_s=long)
        )
        + f"\n# the share of first tokens above {slo.ttft_ms} ms, interpolated",
    }
    results = []
    objectives = [
        ("availability", slo.availability),
        ("latency", slo.latency),
        ("first token", slo.ttft),
    ]
    for name, objective in objectives:
        if objective is None:
            continue
        burns = {w: burn_rate(bad[w, True][name], objective) for w in windows}
        found = gate(burns, spec.slo_burn_limit, objective, name)
        results.append(
            Result(
                f"{name} burn rate",
                f"{queries[name]}\n{where}",
                burns[long],
                burn_rate(bad[long, False][name], objective),
                spec.slo_burn_limit,
                found.verdict if enough else Verdict.INCONCLUSIVE,
                found.detail if enough else "too few requests to judge",
                kind=Kind.BURN,
            )
        )
    return results


def _bad_shares(
    nodes: set[str],
    ok: dict[str, float],
    failed: dict[str, float],
    quantiles: dict[str, dict[float, float]],
    budget_ms: int | None,
) -> dict[str, float | None]:
    """Of `nodes`' requests in a window: the share that failed, and the share slower than the
    budget (each node's from its summary, weighted by its successful requests)."""
    served = sum(ok.get(n, 0.0) for n in nodes)
    failures = sum(failed.get(n, 0.0) for n in nodes)
    slow = weight = 0.0
    for node in nodes:
        share = over_budget(quantiles.get(node, {}), budget_ms * 1000) if budget_ms else None
        if share is not None:
            slow, weight = slow + share * ok.get(node, 0.0), weight + ok.get(node, 0.0)
    return {
        "availability": failures / (served + failures) if served + failures else None,
        "latency": slow / weight if weight else None,
    }


def _slow_first_tokens(
    model: str, pool: str, window_s: int, threshold_ms: int, canary: set[str]
) -> dict[bool, float | None]:
    """Of each side's first tokens in the window (canary: True), the share slower than
    `threshold_ms`, over every backend that counts them (each in its own buckets' units)."""
    slow: dict[bool, float] = {True: 0.0, False: 0.0}
    total: dict[bool, float] = {True: 0.0, False: 0.0}
    for source, query in first_token_buckets(model=model, pool=pool, window_s=window_s):
        sides: dict[bool, dict[float, float]] = {True: {}, False: {}}
        for labels, value in instant_query(query):
            if "node" in labels and "le" in labels and not math.isnan(value):
                bound = float(labels["le"]) * source.scale
                bins = sides[labels["node"] in canary]
                bins[bound] = bins.get(bound, 0.0) + value
        for side, found in sides.items():
            share = over_threshold(found, threshold_ms)
            if share is not None:
                slow[side] += share * found[math.inf]
                total[side] += found[math.inf]
    return {side: slow[side] / total[side] if total[side] else None for side in (True, False)}


@dataclass(frozen=True)
class Share:
    percent: float | None  # None: no request in the window, or Prometheus did not answer
    window_s: int
    query: str
    error: str = ""


def observed_share(*, model: str, pool: str, canary_nodes: list[str], since_s: float) -> Share:
    """The share of the pool's requests for `model` that canary nodes answered since the step's
    canary was READY (`since_s` ago; 30 s at least, for two scrapes, and a minute at most), from
    Triton's own counters: by node, since an unversioned request goes to the highest READY
    version and an ensemble's own metrics do not carry the version that served."""
    window = int(max(30, min(60, since_s)))
    query = canary_queries(model=model, pool=pool, window_s=window)["ok"]
    try:
        served = _by("node", query)
    except PrometheusUnavailable as exc:
        return Share(None, window, query, str(exc))
    total = sum(served.values())
    canary = sum(count for node, count in served.items() if node in canary_nodes)
    return Share(100 * canary / total if total else None, window, query)
