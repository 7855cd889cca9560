"""Reads of evaluation sets and runs that pages, the API and the rollouts share; each a bounded
number of queries, whatever the number of cases or runs."""

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, QuerySet

from apps.quality.models import CaseResult, EvaluationCase, EvaluationRun, EvaluationSet


def latest_set(*, model_id: int, name: str) -> EvaluationSet | None:
    return EvaluationSet.objects.filter(model_id=model_id, name=name).order_by("-version").first()


def set_list(*, model_id: int) -> QuerySet[EvaluationSet]:
    return (
        EvaluationSet.objects.filter(model_id=model_id)
        .select_related("model")
        .annotate(case_count=Count("cases"))
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
