"""Rollout plans and analysis specs: parsed and checked before anything reaches a node."""

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from apps.performance.analyzer import PerfError, concurrency_range
from apps.prometheus.catalog import PLACEHOLDERS


class PlanError(ValueError):
    """What is wrong with a plan or analysis spec, and where (line or field)."""


@dataclass(frozen=True)
class Step:
    nodes: int | None = None  # a number of canary nodes...
    # ...or a share of the pool's requests: by weight on a pool with a traffic strategy (on
    # as many nodes as the share rounds up to), else the whole nodes that share rounds up to.
    percent: int | None = None
    hold_s: int = 0

    def canary_count(self, pool_size: int) -> int:
        if self.nodes is not None:
            return min(self.nodes, pool_size)
        assert self.percent is not None
        return min(pool_size, max(1, math.ceil(pool_size * self.percent / 100)))

    @property
    def share(self) -> str:
        count = f"{self.nodes} node{'s' if self.nodes != 1 else ''}" if self.nodes else ""
        return count or f"{self.percent}%"

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


UNITS = {"s": 1, "m": 60, "h": 3600}
JUDGES = ("threshold", "statistical")
MAX_PERF_REQUESTS = 10_000  # at each concurrency, for each of the performance gate's runs
POSITIVE = (
    "interval_s",
    "window_s",
    "sample_s",
    "slo_short_s",
    "quality_timeout_s",
    "quality_concurrency",
    "perf_requests",
    "perf_timeout_s",
)  # analysis fields, 1 at least
LINE = re.compile(
    r"^\s*(?:(?P<nodes>\d+)\s*nodes?|(?P<percent>\d+)\s*%)\s*"
    r"(?:,?\s*hold\s+(?P<hold>\d+)\s*(?P<unit>[smh]))?\s*$",
    re.IGNORECASE,
)


def parse_duration(value: object, where: str) -> int:
    if isinstance(value, int) and value >= 0:
        return value
    found = re.fullmatch(r"(\d+)\s*([smh])", str(value).strip())
    if not found:
        raise PlanError(f"{where}: hold {value!r} is not a duration such as 60s, 2m or 1h")
    return int(found[1]) * UNITS[found[2]]


def parse_plan(plan: str | list[dict[str, Any]]) -> list[Step]:
    """One step per line (`1 node, hold 60s` / `50%, hold 2m` / `100%`), or the stored form
    (`[{"nodes": 1, "hold_s": 60}, ...]`, `hold` also accepted as "60s")."""
    steps = []
    if isinstance(plan, str):
        lines = [(n, line) for n, line in enumerate(plan.splitlines(), 1) if line.strip()]
        for number, line in lines:
            found = LINE.match(line)
            if not found:
                raise PlanError(
                    f"line {number}: {line.strip()!r} is not a step; write '1 node, hold 60s', "
                    "'50%, hold 2m' or '100%'"
                )
            hold = found["hold"] and int(found["hold"]) * UNITS[found["unit"].lower()]
            steps.append(_step(found["nodes"], found["percent"], hold or 0, where=f"line {number}"))
    else:
        for number, raw in enumerate(plan, 1):
            if not isinstance(raw, dict) or ("nodes" in raw) == ("percent" in raw):
                raise PlanError(f"step {number}: give either 'nodes' or 'percent'")
            hold = parse_duration(raw.get("hold_s", raw.get("hold", 0)), f"step {number}")
            steps.append(_step(raw.get("nodes"), raw.get("percent"), hold, f"step {number}"))
    if not steps:
        raise PlanError("a plan needs at least one step")
    return steps


def _step(nodes: object, percent: object, hold_s: int, where: str) -> Step:
    try:
        step = Step(
            nodes=None if nodes is None else int(str(nodes)),
            percent=None if percent is None else int(str(percent)),
            hold_s=hold_s,
        )
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from exc
    if step.nodes is not None and step.nodes < 1:
        raise PlanError(f"{where}: a step puts the canary on 1 node at least")
    if step.percent is not None and not 1 <= step.percent <= 100:
        raise PlanError(f"{where}: a share is between 1% and 100%")
    return step


@dataclass(frozen=True)
class CustomMetric:
    """A series of the analysis's own (the application's helpful-answer ratio, a pipeline's
    requests a node), queried once per side with that side's `$nodes` or `$version`, and judged
    canary against baseline."""

    PREFIX = "custom: "  # what its measurements are named: the prefix, then its name

    name: str
    query: str
    higher_is_better: bool
    tolerance: float = 0.05  # the canary may be this share worse than the baseline
    min: float | None = None  # absolute bounds, held at every step, a 100% one too
    max: float | None = None

    @classmethod
    def from_dict(cls, raw: object, where: str) -> "CustomMetric":
        if not isinstance(raw, dict):
            raise PlanError(f"{where}: {raw!r} is not an object with a name and a query")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise PlanError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(known)}")
        for name in ("name", "query"):
            if not isinstance(raw.get(name), str) or not raw[name].strip():
                raise PlanError(f"{where}.{name}: a metric needs one")
        if len(raw["name"]) > 80:
            raise PlanError(f"{where}.name: 80 characters at most")
        used = set(re.findall(r"\$(\w+)", raw["query"]))
        if used - set(PLACEHOLDERS):
            raise PlanError(
                f"{where}.query: unknown placeholder ${sorted(used - set(PLACEHOLDERS))[0]};"
                f" known: {', '.join('$' + p for p in PLACEHOLDERS)}"
            )
        if not used & {"nodes", "version"}:
            raise PlanError(
                f"{where}.query: names neither $nodes nor $version, so it could not tell the"
                " canary from the baseline"
            )
        if not isinstance(raw.get("higher_is_better"), bool):
            raise PlanError(f"{where}.higher_is_better: true or false is needed")
        values = {
            name: _number(raw[name], f"{where}.{name}")
            for name in ("tolerance", "min", "max")
            if raw.get(name) is not None
        }
        if values.get("tolerance", 0.0) < 0:
            raise PlanError(f"{where}.tolerance: {raw['tolerance']!r} is below 0")
        low, high = values.get("min"), values.get("max")
        if low is not None and high is not None and low > high:
            raise PlanError(f"{where}.min: {low:g} is above max {high:g}")
        return cls(raw["name"].strip(), raw["query"], raw["higher_is_better"], **values)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def looser_than(self, other: "CustomMetric") -> list[str]:
        """Where this metric lets through what `other` (of the same name) would stop."""
        found = [] if self.query == other.query else ["another query"]
        if self.higher_is_better != other.higher_is_better:
            found.append("the other way round")
        if self.tolerance > other.tolerance:
            found.append(f"tolerance {self.tolerance:g}, the template's {other.tolerance:g}")
        for bound, mine, theirs, sign in [
            ("min", self.min, other.min, -1),
            ("max", self.max, other.max, 1),
        ]:
            if theirs is not None and (mine is None or (mine - theirs) * sign > 0):
                shown = "none" if mine is None else f"{mine:g}"
                found.append(f"{bound} {shown}, the template's {theirs:g}")
        return found


def _number(value: object, where: str) -> float:
    try:
        number = math.nan if isinstance(value, bool) else float(str(value))
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise PlanError(f"{where}: {value!r} is not a number")
    return number


@dataclass(frozen=True)
class Analysis:
    """How each step is judged: every `interval_s`, over the last `window_s`, canary against
    baseline."""

    interval_s: int = 10
    window_s: int = 60
    warmup_s: int = 30  # after a step's canary is READY, before its first window opens
    p99_tolerance: float = 0.2  # canary P99 <= baseline P99 x (1 + tolerance), and <= the budget
    p99_margin_ms: int = 10  # ...unless within this of the baseline: a 2 ms baseline is all noise
    error_delta: float = 0.01  # canary error ratio <= baseline's + delta
    min_requests: int = 20  # fewer in the window, on either side: inconclusive
    failure_limit: int = 2  # failed measurements before the rollout rolls back
    error_limit: int = 3  # Prometheus errors in a row before it rolls back
    converge_timeout_s: int = 300  # a step's canary must be READY within this
    # "statistical": the window's per-interval samples, canary against baseline
    # (apps/rollouts/judge.py); "threshold": single values over the window against the limits
    # above, which a fresh canary's first slow requests can fail on small traffic (issue 17).
    judge: str = "statistical"
    sample_s: int = 5  # one sample per node every this, for the statistical judge
    confidence: float = 0.95  # "worse" when the Mann-Whitney p-value is below 1 - this
    latency_tolerance: float = 0.1  # the canary's median latency may be this much higher...
    latency_margin_ms: float = 5.0  # ...or this many ms: 10 % of 3 ms is noise
    error_tolerance: float = 0.01  # ...and its mean error ratio this much higher
    # ...and an LLM step's median time to first token, per output token and answer length
    llm_tolerance: float = 0.2
    # ...and its KV cache no fuller than this on any canary node (a full cache makes requests
    # wait for memory), where its backend exports its use; unless the baseline's is as full
    kv_cache_max: float = 0.95
    pass_score: float = 0.75  # the weighted share of metrics that pass, for a success
    # The SLO burn-rate gate, for models that declare objectives (apps/rollouts/slo.py): a step
    # fails when the canary spends its error budget faster than this many times the sustainable
    # rate over both the last `slo_short_s` (two scrapes at least) and the whole window.
    slo_burn_limit: float = 14.4
    slo_short_s: int = 15
    # Measure and record every verdict, never act on one: to tune the analysis on a live release.
    dry_run: bool = False
    # An LLM step's first token and longest answer (`max_tokens` at the measured time per token)
    # must fit its budget: always warned of before it starts; refused as well when strict.
    strict_budget: bool = False
    # After a blue-green switch: for this long the release before stays loaded and users'
    # requests are watched (errors within error_delta, the P99 within the model's budget, with
    # min_requests at least) before the release succeeds; it rolls back by itself otherwise.
    switch_hold_s: int = 60
    # The quality gate (apps/quality): the model's evaluation set of this name runs through
    # Triton against canary and baseline once the canary is READY, before it gets any traffic;
    # the canary must score `quality_min_score` and stay within `quality_tolerance` of the
    # baseline's score. None named: no gate.
    quality_set: str = ""
    quality_min_score: float = 0.9
    quality_tolerance: float = 0.05
    quality_timeout_s: float = 10.0  # per case: one that takes longer fails, with that reason
    quality_concurrency: int = 4
    quality_every: int = 0  # during steps, the set again every this many rounds; 0: never
    # The performance gate (apps/rollouts/perf_gate.py): once the first step's canary is READY
    # and still drained, perf_analyzer measures canary and baseline on that node, each served
    # with its own config, in the order canary, baseline, baseline, canary, at each concurrency
    # of this range ("4", "1:4", "2:8:2"), `perf_requests` requests at each (`perf_timeout_s` at
    # most). The canary's throughput may be `perf_throughput_tolerance` below the baseline's, its
    # P99 `perf_p99_tolerance` above it (or `latency_margin_ms`). None given: no gate.
    perf_concurrency: str = ""
    perf_requests: int = 200
    perf_throughput_tolerance: float = 0.1
    perf_p99_tolerance: float = 0.25
    perf_timeout_s: int = 60
    # Where a side served fewer than `min_requests` in a round, the set's inputs are sent to its
    # nodes at this rate (requests per second) for the rest of the step; 0: never.
    synthetic_rps: float = 0.0
    # The analysis's own series (answer quality, a pipeline's requests a node), judged like
    # latency (apps/rollouts/analysis.py); measured as `CustomMetric.PREFIX` + name.
    metrics: tuple[CustomMetric, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Analysis":
        defaults = asdict(cls())
        known: dict[str, Callable[[Any], Any]] = {k: type(v) for k, v in defaults.items()}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise PlanError(f"analysis: unknown field {unknown[0]!r}; known: {', '.join(known)}")
        values: dict[str, Any] = {}
        for name, raw_value in raw.items():
            if name == "judge":
                if raw_value not in JUDGES:
                    raise PlanError(f"analysis.judge: {raw_value!r} is not one of {JUDGES}")
                values[name] = raw_value
                continue
            if name == "quality_set":
                if not isinstance(raw_value, str) or not re.fullmatch(r"[-\w]{0,60}", raw_value):
                    raise PlanError(f"analysis.quality_set: {raw_value!r} is not a set's name")
                values[name] = raw_value
                continue
            if name == "metrics":
                values[name] = _metrics(raw_value)
                continue
            if name == "perf_concurrency":
                values[name] = str(raw_value).strip()
                continue
            if name in ("dry_run", "strict_budget"):
                if raw_value not in (True, False, "true", "false"):
                    raise PlanError(f"analysis.{name}: {raw_value!r} is not true or false")
                values[name] = raw_value in (True, "true")
                continue
            try:
                value = known[name](raw_value)
            except (TypeError, ValueError):
                raise PlanError(f"analysis.{name}: {raw_value!r} is not a number") from None
            positive = name.endswith("_limit") or name in POSITIVE
            share = name in ("confidence", "pass_score", "quality_min_score")
            if value < 0 or (positive and value < 1) or (share and not 0 < value <= 1):
                raise PlanError(f"analysis.{name}: {raw_value!r} is out of range")
            values[name] = value
        if values.get("synthetic_rps") and not values.get("quality_set"):
            raise PlanError("analysis.synthetic_rps: needs a quality_set, whose inputs it sends")
        if values.get("synthetic_rps", 0) > 100:
            raise PlanError("analysis.synthetic_rps: 100 requests per second at most")
        found = cls(**values)
        if found.perf_concurrency:
            try:
                concurrency_range(found.perf_concurrency, found.perf_timeout_s)
            except PerfError as exc:
                raise PlanError(f"analysis.perf_concurrency: {exc}") from None
        if found.perf_requests > MAX_PERF_REQUESTS:
            raise PlanError(f"analysis.perf_requests: {MAX_PERF_REQUESTS} at most")
        return found

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON, as a JSONField keeps it: `from_dict` reads it back equal."""
        return asdict(self) | {"metrics": [m.as_dict() for m in self.metrics]}

    def looser_than(self, other: "Analysis") -> list[str]:
        """Where this analysis lets through what `other` would stop, field by field."""
        found = [f"judge {self.judge}, not {other.judge}"] if self.judge != other.judge else []
        found += ["a dry run"] if self.dry_run and not other.dry_run else []
        if other.quality_set and self.quality_set != other.quality_set:
            found.append(f"quality set {self.quality_set or 'none'!r}, not {other.quality_set!r}")
        if other.perf_concurrency and self.perf_concurrency != other.perf_concurrency:
            found.append(
                f"performance gate at concurrency {self.perf_concurrency or 'none'!r}, not "
                f"{other.perf_concurrency!r}"
            )
        for name, higher_is_looser in LOOSER_WHEN_HIGHER.items():
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs and (mine > theirs) == higher_is_looser:
                found.append(f"{name} {mine}, the template's {theirs}")
        kept = {m.name: m for m in self.metrics}
        for metric in other.metrics:
            if metric.name not in kept:
                found.append(f"no metric {metric.name!r}, which the template judges")
            elif looser := kept[metric.name].looser_than(metric):
                found.append(f"metric {metric.name!r}: {', '.join(looser)}")
        return found


def _metrics(raw: object) -> tuple[CustomMetric, ...]:
    if not isinstance(raw, list | tuple):
        raise PlanError(f"analysis.metrics: {raw!r} is not a list")
    found: list[CustomMetric] = []
    for number, each in enumerate(raw):
        metric = CustomMetric.from_dict(each, f"analysis.metrics[{number}]")
        if any(m.name == metric.name for m in found):
            raise PlanError(f"analysis.metrics[{number}].name: {metric.name!r} is named twice")
        found.append(metric)
    return tuple(found)


# Each gate of an analysis, and whether a higher value lets more through. A higher confidence
# needs a smaller p-value to call the canary worse.
LOOSER_WHEN_HIGHER = {
    "p99_tolerance": True,
    "p99_margin_ms": True,
    "error_delta": True,
    "min_requests": False,
    "failure_limit": True,
    "error_limit": True,
    "confidence": True,
    "latency_tolerance": True,
    "latency_margin_ms": True,
    "error_tolerance": True,
    "llm_tolerance": True,
    "kv_cache_max": True,
    "pass_score": False,
    "slo_burn_limit": True,
    "quality_min_score": False,
    "quality_tolerance": True,
    "perf_requests": False,
    "perf_throughput_tolerance": True,
    "perf_p99_tolerance": True,
    "switch_hold_s": False,
    "strict_budget": False,
}


@dataclass(frozen=True)
class PreviewStep:
    index: int
    step: Step
    canary_nodes: list[str]
    baseline_nodes: list[str]
    weighted: bool = False  # the pool's balancer gives a percent step its exact share

    @property
    def analysed(self) -> bool:
        """With no baseline node left there is nothing to compare against: the step only holds."""
        return bool(self.baseline_nodes)

    @property
    def real_percent(self) -> int:
        """The share of the pool's requests the canary really gets: the one asked where the
        pool's balancer weighs nodes, else its share of the nodes."""
        if self.weighted and self.step.percent is not None:
            return self.step.percent
        nodes = len(self.canary_nodes + self.baseline_nodes)  # none: the pool's nodes are gone
        return round(100 * len(self.canary_nodes) / nodes) if nodes else 0

    @property
    def overshoots(self) -> bool:
        """A share asked in percent that whole nodes give more than twice of (5% of 3 nodes is
        one node: 33%)."""
        return self.step.percent is not None and self.real_percent > 2 * self.step.percent

    @property
    def real_share(self) -> str:
        nodes = len(self.canary_nodes + self.baseline_nodes)
        how = "weighted " if self.weighted else ""
        canary = len(self.canary_nodes)
        return f"{self.real_percent}% of requests, {how}on {canary} of {nodes} nodes"


def canary_nodes(step: Step, nodes: list[str]) -> list[str]:
    """The same nodes, in name order, at every step: a step only adds canary nodes."""
    ordered = sorted(nodes)
    return ordered[: step.canary_count(len(ordered))]


def preview(steps: list[Step], nodes: list[str], *, weighted: bool = False) -> list[PreviewStep]:
    rows = []
    for index, step in enumerate(steps):
        canary = canary_nodes(step, nodes)
        rows.append(PreviewStep(index, step, canary, sorted(set(nodes) - set(canary)), weighted))
    return rows
