"""The overview's live tiles: what the fleet serves, its worst P99 against budget, its errors."""

from dataclasses import dataclass

from apps.observability.breakdown import worst_p99_ms
from apps.prometheus.catalog import failed_rate_by_model, served_rate_by_model
from apps.prometheus.client import instant_query
from apps.registry.codec import step_names
from apps.registry.models import Model, ModelVersion


@dataclass(frozen=True)
class Worst:
    model: str
    version: int
    p99_ms: float
    budget_ms: int | None

    @property
    def breach(self) -> bool:
        return self.budget_ms is not None and self.p99_ms > self.budget_ms


@dataclass(frozen=True)
class Tiles:
    throughput_rps: float
    error_ratio: float | None  # None without requests
    worst: Worst | None  # None without requests

    @property
    def error_percent(self) -> float | None:
        return None if self.error_ratio is None else 100 * self.error_ratio


def _steps() -> set[str]:
    """Models that ensembles call: their requests are already counted at the ensemble."""
    configs = ModelVersion.objects.filter(model__kind=Model.Kind.ENSEMBLE).values_list(
        "config", flat=True
    )
    return {name for config in configs for name in step_names(config)}


def _by_model(query: str) -> dict[str, float]:
    return {labels["model"]: value for labels, value in instant_query(query) if "model" in labels}


def fleet_tiles() -> Tiles:
    """Entry points only (ensembles, and models no ensemble calls): a request through a
    four-step pipeline counts once. Raises PrometheusUnavailable."""
    steps = _steps()
    success = _by_model(served_rate_by_model())
    failure = _by_model(failed_rate_by_model())
    served = sum(v for m, v in success.items() if m not in steps)
    failed = sum(v for m, v in failure.items() if m not in steps)
    budgets = dict(Model.objects.values_list("name", "latency_budget_ms"))
    p99 = worst_p99_ms(sorted(budgets)) if budgets else {}

    def severity(item: tuple[tuple[str, int], float]) -> tuple[bool, float]:
        (model, _), value = item
        budget = budgets.get(model)
        return (budget is not None, value / budget if budget else value)

    worst = max(p99.items(), key=severity, default=None)
    return Tiles(
        throughput_rps=served,
        error_ratio=failed / (served + failed) if served + failed else None,
        worst=worst and Worst(worst[0][0], worst[0][1], worst[1], budgets.get(worst[0][0])),
    )
