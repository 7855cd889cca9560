"""When a pool's pipeline has broken its latency budget, its error objective or an LLM step's
first-token objective, or is saturated (its requests rejected, a queue full; or waiting in queues
far longer than they compute), judged from Triton's own series over a short and a long window,
burn-rate style: both must agree, so that one slow scrape never decides, and each needs a
minimum of requests. Missing data decides nothing: it is said, and the pool stays where it is."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Window:
    """One window's figures: requests served and failed in it, the worst node's P99 (ms)."""

    window_s: int
    ok: float | None
    failed: float | None
    p99_ms: float | None
    rejected: float | None = None  # requests Triton turned away, its queue full
    queue_us: float | None = None  # time the pipeline's requests waited in queues, its steps'
    compute_us: float | None = None  # ... and computed
    queue_held: float | None = None  # their ratio's median over the window, a slice at a time
    ttft_ms: dict[str, float] = field(default_factory=dict)  # an LLM's first tokens' P99, by model

    @property
    def queue_ratio(self) -> float | None:
        """Queue time over compute time, where both were read and something computed."""
        if self.queue_us is None or not self.compute_us:
            return None
        return self.queue_us / self.compute_us

    @property
    def requests(self) -> float:
        return (self.ok or 0.0) + (self.failed or 0.0)

    @property
    def error_ratio(self) -> float:
        return (self.failed or 0.0) / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Limits:
    budget_ms: float | None  # the model's latency budget
    max_error_ratio: float | None  # 1 - its availability objective
    min_requests: int
    max_queue_ratio: float | None = None  # saturated past this much queue time per compute time
    ttft_ms: dict[str, int] = field(default_factory=dict)  # first-token objectives, by model


@dataclass(frozen=True)
class Finding:
    breached: bool
    evidence: str  # what was measured, in words: why it breached, or why nothing is decided
    measured: bool = True  # False: too little data to judge either way


def judge(short: Window, long: Window, limits: Limits) -> Finding:
    """Breached when the P99 is over the budget, or the error ratio over the objective, in both
    windows, each with enough requests."""
    for window in (short, long):
        if window.ok is None or window.p99_ms is None:
            return Finding(
                False, f"no data over {window.window_s} s: nothing is decided", measured=False
            )
        if window.requests < limits.min_requests:
            return Finding(
                False,
                f"{window.requests:.0f} requests over {window.window_s} s, "
                f"{limits.min_requests} needed: nothing is decided",
                measured=False,
            )
    found = []
    if limits.budget_ms is not None and min(short.p99_ms or 0, long.p99_ms or 0) > limits.budget_ms:
        found.append(
            f"P99 {short.p99_ms:.0f} ms over {short.window_s} s and {long.p99_ms:.0f} ms over "
            f"{long.window_s} s, budget {limits.budget_ms:.0f} ms"
        )
    ratios = (short.error_ratio, long.error_ratio)
    if limits.max_error_ratio is not None and min(ratios) > limits.max_error_ratio:
        found.append(
            f"errors {ratios[0]:.2%} over {short.window_s} s and {ratios[1]:.2%} over "
            f"{long.window_s} s, objective at most {limits.max_error_ratio:.2%}"
        )
    found += _saturated(short, long, limits)
    found += _first_tokens(short, long, limits)
    if found:
        return Finding(True, "; ".join(found))
    return Finding(
        False,
        f"within budget: P99 {short.p99_ms:.0f} ms over {short.window_s} s, "
        f"{long.p99_ms:.0f} ms over {long.window_s} s",
    )


def _saturated(short: Window, long: Window, limits: Limits) -> list[str]:
    """Saturation in both windows, in words: requests rejected, or queues far above compute, over
    the short window and for most of the long one (its median slice: a burst of a few seconds
    fills queues enough to outweigh the rest of a long window, and is no saturation)."""
    found = []
    if min(short.rejected or 0, long.rejected or 0) > 0:
        found.append(
            f"{short.rejected:.0f} requests rejected over {short.window_s} s and "
            f"{long.rejected:.0f} over {long.window_s} s: a queue is full"
        )
    first, second, limit = short.queue_ratio, long.queue_held, limits.max_queue_ratio
    if (
        limit is not None
        and first is not None
        and second is not None
        and min(first, second) > limit
    ):
        found.append(
            f"queues {first:.1f}x compute over {short.window_s} s and {second:.1f}x for most of "
            f"{long.window_s} s, at most {limit:g}x"
        )
    return found


def _first_tokens(short: Window, long: Window, limits: Limits) -> list[str]:
    """An LLM step whose first tokens' P99 is over its objective in both windows, in words; one
    with no first token read in a window decides nothing."""
    return [
        f"{model}'s first token P99 {short.ttft_ms[model]:.0f} ms over {short.window_s} s and "
        f"{long.ttft_ms[model]:.0f} ms over {long.window_s} s, objective {limit} ms"
        for model, limit in sorted(limits.ttft_ms.items())
        if min(short.ttft_ms.get(model, 0), long.ttft_ms.get(model, 0)) > limit
    ]
