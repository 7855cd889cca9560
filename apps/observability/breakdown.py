"""Each ensemble step's P99 next to its latency budget, an LLM step's split into its first token
and its longest answer's tokens, and the end-to-end P99 against the total."""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from apps.observability.llm import Fit
from apps.prometheus.catalog import worst_p99_query
from apps.prometheus.client import instant_query


@dataclass(frozen=True)
class StepLatency:
    label: str
    p99_ms: float | None
    budget_ms: int | None
    llm: Fit | None = None  # an LLM step's budget split: its first token, then its tokens

    @property
    def breach(self) -> bool:
        return (
            self.p99_ms is not None and self.budget_ms is not None and self.p99_ms > self.budget_ms
        )


def worst_p99_ms(models: list[str]) -> dict[tuple[str, int], float]:
    """The worst P99 (ms) over the last few minutes and all nodes, per model and version, for all
    `models` in one query."""
    return {
        (labels["model"], int(labels["version"])): value
        for labels, value in instant_query(worst_p99_query(models))
        if not math.isnan(value) and labels.get("version", "").isdecimal()
    }


def serving_version(
    p99: dict[tuple[str, int], float],
    ensemble: str,
    pins: Iterable[tuple[int, set[tuple[str, int]]]],
) -> int | None:
    """The newest version of `ensemble` whose pinned steps (`pins`: version and its steps, newest
    first) all served requests in the window: Triton labels every ensemble version's own series
    `version="1"`, the steps' carry their true versions. Else the newest its own series name."""
    for version, steps in pins:
        if steps and steps <= p99.keys():
            return version
    return max((v for m, v in p99 if m == ensemble), default=None)


def step_breakdown(
    ensemble: tuple[str, int],
    steps: list[tuple[str, int]],
    budgets: dict[str, int | None],
    p99: dict[tuple[str, int], float],
    llm: dict[str, Fit] | None = None,
) -> list[StepLatency]:
    """Rows in pipeline order, an LLM step's with its budget split (`llm`, by model), then the
    ensemble end to end."""
    split = llm or {}
    rows = [
        StepLatency(f"{m} v{v}", p99.get((m, v)), budgets.get(m), split.get(m)) for m, v in steps
    ]
    # The ensemble's own series, whatever version they name: Triton names version 1 for all.
    own = max((v for (m, _), v in p99.items() if m == ensemble[0]), default=None)
    return [*rows, StepLatency("end to end", own, budgets.get(ensemble[0]))]
