"""Whether an LLM step's release fits its latency budget: its first token and its longest answer
(`max_tokens` at the time per output token measured on the pool) against the step's budget,
said with the figures, or said to be unmeasured: a budget is never passed on missing data."""

import re
from dataclasses import dataclass
from typing import Any

from apps.prometheus import llm
from apps.prometheus.client import PrometheusUnavailable, escape_label, instant_query
from apps.registry.codec import from_dict, int_parameter
from apps.registry.ensembles import UnresolvedStep
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import stored_steps

WINDOW = "15m"  # what the pool's first tokens and tokens took lately


@dataclass(frozen=True)
class Fit:
    model: str
    version: int
    max_tokens: int
    budget_ms: int
    ttft_ms: float | None  # the first token's P99 on the pool
    itl_ms: float | None  # the mean time per output token on the pool
    unread: str = ""  # why the pool's figures could not be read

    @property
    def decode_ms(self) -> float | None:
        """The longest answer's tokens after the first."""
        return None if self.itl_ms is None else self.max_tokens * self.itl_ms

    @property
    def worst_ms(self) -> float | None:
        if self.ttft_ms is None or self.decode_ms is None:
            return None
        return self.ttft_ms + self.decode_ms

    @property
    def fits(self) -> bool | None:
        """None: not measured, so not known."""
        return None if self.worst_ms is None else self.worst_ms <= self.budget_ms

    def __str__(self) -> str:
        what = f"{self.model} v{self.version} (max_tokens {self.max_tokens})"
        if self.worst_ms is None:
            missing = self.unread or "no " + " nor ".join(
                name
                for name, value in [("first token", self.ttft_ms), ("tokens", self.itl_ms)]
                if value is None
            )
            return f"{what}: its budget of {self.budget_ms} ms cannot be checked ({missing})"
        assert self.ttft_ms is not None and self.itl_ms is not None
        sum_ = (
            f"first token {self.ttft_ms:.0f} ms (P99) + {self.max_tokens} tokens x "
            f"{self.itl_ms:.1f} ms = {self.worst_ms:.0f} ms"
        )
        verdict = "within" if self.fits else "over"
        return f"{what}: {sum_}, {verdict} its budget of {self.budget_ms} ms"


@dataclass(frozen=True)
class Step:
    """An LLM step a release would serve: its model, version, `max_tokens` and budget."""

    model: str
    version: int
    max_tokens: int
    budget_ms: int


def release_fits(versions: list[tuple[Model, int]], pool: str) -> list[Fit]:
    """Each LLM step that releasing `versions` (model, version) would serve, against its budget
    on `pool`: each released version, and each step a released pipeline pins, that says its
    `max_tokens` and has a budget."""
    released = ModelVersion.objects.filter(
        model__in=[model for model, _ in versions], version__in={v for _, v in versions}
    ).select_related("model")
    configs: dict[tuple[str, int], Any] = {}
    for found in released:
        if (found.model, found.version) in versions:
            configs[(found.model.name, found.version)] = from_dict(found.config)
            try:
                configs |= stored_steps(found.config)
            except UnresolvedStep:  # the release is refused for it on its own
                continue
    budgets = dict(
        Model.objects.filter(name__in={name for name, _ in configs}).values_list(
            "name", "latency_budget_ms"
        )
    )
    return fits(llm_steps(configs, budgets), pool)


def llm_steps(configs: dict[tuple[str, int], Any], budgets: dict[str, int | None]) -> list[Step]:
    """The LLM steps among (model, version) -> config: those that say their `max_tokens` and
    have a budget."""
    return [
        Step(name, version, tokens, budget)
        for (name, version), config in configs.items()
        if (tokens := int_parameter(config, "max_tokens")) is not None
        and (budget := budgets.get(name))
    ]


def fits(steps: list[Step], pool: str | None = None) -> list[Fit]:
    """Each step against the first tokens and tokens its model served on `pool` (every pool's
    when none) lately, by whatever backend: two queries, however many steps."""
    if not steps:
        return []
    names = escape_label("|".join(re.escape(s.model) for s in steps))
    selector = f'model=~"{names}"' + (f',pool="{escape_label(pool)}"' if pool else "")
    try:
        ttft = _by_model(llm.quantile(llm.TTFT, 0.99, selector=selector, window=WINDOW, by="model"))
        itl = _by_model(llm.mean(llm.ITL, selector=selector, window=WINDOW, by="model"))
        unread = ""
    except PrometheusUnavailable as exc:
        ttft, itl, unread = {}, {}, str(exc)
    return [
        Fit(
            s.model,
            s.version,
            s.max_tokens,
            s.budget_ms,
            ttft.get(s.model),
            itl.get(s.model),
            unread,
        )
        for s in steps
    ]


def _by_model(query: str) -> dict[str, float]:
    return {
        labels["model"]: value
        for labels, value in instant_query(query)
        if "model" in labels and value == value  # NaN: no request in the window
    }
