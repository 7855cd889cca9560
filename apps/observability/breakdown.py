"""Each ensemble step's P99 next to its latency budget, and the end-to-end P99 against the total."""

import math
from dataclasses import dataclass

from apps.prometheus.catalog import worst_p99_query
from apps.prometheus.client import instant_query


@dataclass(frozen=True)
class StepLatency:
    label: str
    p99_ms: float | None
    budget_ms: int | None

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


def serving_version(p99: dict[tuple[str, int], float], ensemble: str) -> int | None:
    """The newest version of `ensemble` that served requests in the window."""
    return max((v for m, v in p99 if m == ensemble), default=None)


def step_breakdown(
    ensemble: tuple[str, int],
    steps: list[tuple[str, int]],
    budgets: dict[str, int | None],
    p99: dict[tuple[str, int], float],
) -> list[StepLatency]:
    """Rows in pipeline order, then the ensemble end to end."""
    rows = [StepLatency(f"{m} v{v}", p99.get((m, v)), budgets.get(m)) for m, v in steps]
    return [*rows, StepLatency("end to end", p99.get(ensemble), budgets.get(ensemble[0]))]
