"""Reads of evaluation sets and runs that pages, the API and the rollouts share; each a bounded
number of queries, whatever the number of cases or runs."""

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, OuterRef, QuerySet, Subquery

from apps.quality.models import CaseResult, EvaluationCase, EvaluationRun, EvaluationSet
from apps.registry.models import Model, ModelVersion


def latest_set(*, model_id: int, name: str) -> EvaluationSet | None:
    return EvaluationSet.objects.filter(model_id=model_id, name=name).order_by("-version").first()


def set_list(*, model_id: int) -> QuerySet[EvaluationSet]:
    return (
        EvaluationSet.objects.filter(model_id=model_id)
        .select_related("model")
        .annotate(case_count=Count("cases"))
        .order_by("name", "-version")  # grouped: Meta.ordering no longer applies
    )


def run_list(**filters: Any) -> QuerySet[EvaluationRun]:
    return EvaluationRun.objects.filter(**filters).select_related(
        "evaluation_set__model", "node", "baseline_node"
    )


@dataclass(frozen=True)
class Row:
    """One case of a run: what the version under test answered, beside the baseline."""

    case: EvaluationCase
    answer: CaseResult | None
    baseline: CaseResult | None

    @property
    def changed(self) -> bool:
        return bool(self.answer and self.baseline and self.answer.outputs != self.baseline.outputs)

    @property
    def failing(self) -> bool:
        return self.answer is not None and self.answer.passed is False

    @property
    def streamed(self) -> list[CaseResult]:
        """Its answers that came as a stream: each keeps its first token and its tokens."""
        return [a for a in (self.answer, self.baseline) if a and a.first_ms is not None]


def run_rows(run: EvaluationRun, *, only: str = "", limit: int = 200) -> list[Row]:
    """The run's cases with both answers; `only` "failing" or "changed". Two queries."""
    results = CaseResult.objects.filter(run=run).select_related("case")
    by_case: dict[int, dict[int, CaseResult]] = {}
    for result in results:
        by_case.setdefault(result.case_id, {})[result.version] = result
    rows = [
        Row(
            answers[run.version].case
            if run.version in answers
            else next(iter(answers.values())).case,
            answers.get(run.version),
            answers.get(run.baseline_version or 0),
        )
        for answers in by_case.values()
    ]
    rows.sort(key=lambda row: row.case.line)
    if only == "failing":
        rows = [row for row in rows if row.failing]
    elif only == "changed":
        rows = [row for row in rows if row.changed]
    return rows[:limit]


def failing_cases(run: EvaluationRun, *, limit: int) -> list[str]:
    """The names of the first `limit` cases the version under test failed, in the set's order:
    one query, which reads no answer, however large the run (a rollout's tick asks it)."""
    failed = CaseResult.objects.filter(run=run, version=run.version, passed=False)
    return list(failed.order_by("case__line").values_list("case__name", flat=True)[:limit])


# Pages -------------------------------------------------------------------------------------------


def set_names(*, model_id: int) -> list[str]:
    """The model's evaluation set names, each once: what a rollout's quality gate may name."""
    names = EvaluationSet.objects.filter(model_id=model_id).values_list("name", flat=True)
    return sorted(set(names.order_by()))


@dataclass(frozen=True)
class Scored:
    """A version of a model with its latest finished evaluation's score, where it has one."""

    version: int
    score: float | None
    set_name: str

    @property
    def label(self) -> str:
        if self.score is None:
            return f"v{self.version}: no evaluation yet"
        return f"v{self.version}: quality {self.score:.0%} ({self.set_name})"


def published_versions(*, model_id: int) -> list[Scored]:
    """The model's versions with status published, newest first, each with the score of its
    latest finished run of any set. One query."""
    latest = EvaluationRun.objects.filter(
        evaluation_set__model_id=model_id,
        version=OuterRef("version"),
        status=EvaluationRun.Status.DONE,
        score__isnull=False,
    ).order_by("-created_at", "-id")
    rows = (
        ModelVersion.objects.filter(model_id=model_id, status=ModelVersion.Status.PUBLISHED)
        .annotate(
            score=Subquery(latest.values("score")[:1]),
            set_name=Subquery(latest.values("evaluation_set__name")[:1]),
        )
        .order_by("-version")
        .values_list("version", "score", "set_name")
    )
    return [Scored(version, score, name or "") for version, score, name in rows]


def latest_done_run(*, model_id: int, version: int) -> EvaluationRun | None:
    return (
        run_list(
            evaluation_set__model_id=model_id, version=version, status=EvaluationRun.Status.DONE
        )
        .order_by("-created_at", "-id")
        .first()
    )


@dataclass(frozen=True)
class Check:
    """One output of a case as a page shows it: its rule, what each side answered, the verdict."""

    output: str
    rule: str  # empty for an output no rule looks at
    passed: bool | None
    detail: str
    answer: str
    baseline: str

    @property
    def changed(self) -> bool:
        return self.answer != self.baseline


def checks(row: Row) -> list[Check]:
    """Every output of the case that a rule judges or either side answered, rules first."""
    rules = row.case.expect
    answer = row.answer.outputs if row.answer else {}
    baseline = row.baseline.outputs if row.baseline else {}
    scores = row.answer.scores if row.answer else {}
    names = [*rules, *sorted((answer.keys() | baseline.keys()) - rules.keys())]
    return [
        Check(
            output=name,
            rule=rule_text(rules[name]) if name in rules else "",
            passed=scores.get(name, {}).get("passed"),
            detail=scores.get(name, {}).get("detail", ""),
            answer=shown(answer[name]) if name in answer else "",
            baseline=shown(baseline[name]) if name in baseline else "",
        )
        for name in names
    ]


def rule_text(rule: dict[str, Any]) -> str:
    """A rule (as apps/quality/rules.py normalizes it) in a few words."""
    if "agrees" in rule:
        extra = {k: v for k, v in rule.items() if k != "agrees" and v is not None}
        return f"agrees with the baseline ({rule['agrees']}{_params(extra)})"
    if "exact" in rule:
        return f"exactly {_json(rule['exact'])}"
    if "contains" in rule:
        return f"contains {_json(rule['contains'])}" + (
            ", ignoring case" if rule.get("ignore_case") else ""
        )
    if "close_to" in rule:
        tolerance = "abs" if "abs" in rule else "rel"
        return f"close to {_json(rule['close_to'])} within {tolerance} {rule[tolerance]:g}"
    if "top_k" in rule:
        share = f", {rule['min']:.0%} of them at least" if rule.get("min", 1) < 1 else ""
        key = f" (by {rule['key']})" if rule.get("key") else ""
        return f"first {rule['k']}{key} include {_json(rule['top_k'])}{share}"
    if "cosine" in rule:
        return f"cosine with {_json(rule['cosine'])} at least {rule['min']:g}"
    return _json(rule)


def shown(value: Any, limit: int = 400) -> str:
    """An output as a person reads it: a one-element tensor as its element, text unquoted."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    text = value if isinstance(value, str) else _json(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _params(values: dict[str, Any]) -> str:
    return "".join(f", {key} {_json(value)}" for key, value in values.items())


@dataclass(frozen=True)
class Shown:
    """A run's case as its pages show it: the row, its inputs and its outputs' checks."""

    row: Row
    inputs: list[tuple[str, str]]
    checks: list[Check]


def shown_rows(rows: Iterable[Row], *, judged_only: bool = False) -> list[Shown]:
    """`judged_only`: only the outputs a rule looks at (where a page lists failing cases)."""
    return [
        Shown(
            row,
            [(k, shown(v)) for k, v in row.case.inputs.items()],
            [c for c in checks(row) if c.rule or not judged_only],
        )
        for row in rows
    ]


def reference_version(model: Model) -> ModelVersion | None:
    """The version whose config a set is checked against: the newest with status published,
    else the newest."""
    versions = model.versions.order_by("-version")
    return versions.filter(status=ModelVersion.Status.PUBLISHED).first() or versions.first()
