"""Evaluation sets and runs: a set's next version from JSON Lines, a run of it queued against a
version (beside a baseline), and its answers read back case by case."""

from datetime import datetime
from typing import Annotated, Any, Literal

from django.http import Http404, HttpRequest
from django.shortcuts import get_object_or_404
from django.urls import reverse
from ninja import File, Form, Router, Schema, Status
from ninja.files import UploadedFile
from pydantic import Field

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS
from apps.api.paging import Limit, Offset
from apps.fleet.models import Node
from apps.quality.cases import MAX_BYTES, Problem
from apps.quality.errors import QualityError
from apps.quality.models import CaseResult, EvaluationRun, EvaluationSet
from apps.quality.selectors import Row, latest_set, run_list, run_rows, set_list
from apps.quality.services import evaluation_set_import, evaluation_start
from apps.registry.models import Model, ModelVersion

router = Router(tags=["quality"], auth=Token())

# What the database's integer columns hold: a larger number is a 422, never an overflow.
Number = Annotated[int, Field(ge=1, le=2**31 - 1)]


class EvaluationSetOut(Schema):
    id: int
    model: str
    name: str
    version: int
    cases: int
    source: str
    created_by: str
    created_at: datetime


class CaseOut(Schema):
    line: int
    name: str
    inputs: dict[str, Any]
    expect: dict[str, dict[str, Any]]


class EvaluationSetDetailOut(EvaluationSetOut):
    items: list[CaseOut]  # `limit` of the cases from `offset`, in the file's order


class RunIn(Schema):
    """Run `set` of `model` (its latest version unless `set_version`) against `version`, and
    each case again against `baseline_version` where one is named. `node` and `baseline_node`
    null: a reachable node that has that version READY."""

    model: str
    set: str
    set_version: Number | None = None
    version: Number
    baseline_version: Number | None = None
    node: str | None = None
    baseline_node: str | None = None
    concurrency: int = 4  # cases in flight at once, 1 to 64
    timeout_s: float = 10.0  # per case, up to 600
    purpose: str = ""


class RunOut(Schema):
    id: int
    model: str
    set: str
    set_version: int
    version: int
    baseline_version: int | None
    node: str | None
    baseline_node: str | None
    status: str
    purpose: str
    requested_by: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    score: float | None  # the share of cases passed
    baseline_score: float | None
    passed: int
    failed: int
    error: str  # why it could not run at all (status failed)
    links: dict[str, str]


class AnswerOut(Schema):
    version: int
    outputs: dict[str, Any]
    scores: dict[str, Any]  # output -> {passed, value, detail}, as its rule judged it
    passed: bool | None  # null: no rule applied
    latency_ms: float | None
    first_ms: float | None  # a streamed answer's first token, after the request
    tokens: int | None  # a streamed answer's responses, one a token
    error: str  # Triton's refusal, or the timeout


class RunCaseOut(Schema):
    case: str
    line: int
    changed: bool  # the version answered otherwise than the baseline
    answer: AnswerOut | None  # null: not answered yet
    baseline: AnswerOut | None


class RunDetailOut(RunOut):
    cases: list[RunCaseOut]


def _set_out(found: EvaluationSet, cases: int) -> dict[str, Any]:
    return {
        **{f: getattr(found, f) for f in ("id", "name", "version", "source", "created_by")},
        "model": found.model.name,
        "cases": cases,
        "created_at": found.created_at,
    }


def _run_out(run: EvaluationRun) -> dict[str, Any]:
    fields = ["id", "version", "baseline_version", "status", "purpose", "requested_by"]
    fields += ["created_at", "started_at", "finished_at", "score", "baseline_score"]
    fields += ["passed", "failed", "error"]
    return {
        **{f: getattr(run, f) for f in fields},
        "model": run.evaluation_set.model.name,
        "set": run.evaluation_set.name,
        "set_version": run.evaluation_set.version,
        "node": run.node.name if run.node else None,
        "baseline_node": run.baseline_node.name if run.baseline_node else None,
        "links": {
            "self": reverse("api:get_evaluation_run", kwargs={"run_id": run.pk}),
            "set": reverse("api:get_evaluation_set", kwargs={"set_id": run.evaluation_set_id}),
        },
    }


def _answer_out(result: CaseResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    fields = ("version", "outputs", "scores", "passed", "latency_ms", "first_ms", "tokens", "error")
    return {f: getattr(result, f) for f in fields}


def _row_out(row: Row) -> dict[str, Any]:
    return {
        "case": row.case.name,
        "line": row.case.line,
        "changed": row.changed,
        "answer": _answer_out(row.answer),
        "baseline": _answer_out(row.baseline),
    }


@router.get("/models/{name}/evaluation-sets", response={200: list[EvaluationSetOut], **ERRORS})
def list_evaluation_sets(
    request: HttpRequest, name: str, offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """The model's evaluation sets, every version of each: by name, newest version first,
    `limit` from `offset`."""
    model = get_object_or_404(Model, name=name)
    # Ordered here: Django drops Meta.ordering from a query that groups (the count of cases).
    found = set_list(model_id=model.pk).order_by("name", "-version")[offset : offset + limit]
    return [_set_out(s, s.case_count) for s in found]  # type: ignore[attr-defined]


@router.post(
    "/models/{name}/evaluation-sets",
    response={200: EvaluationSetOut, 201: EvaluationSetOut, **ERRORS},
    auth=can("quality.add_evaluationset", "evaluation_set.import"),
)
def import_evaluation_set(
    request: HttpRequest,
    name: str,
    file: File[UploadedFile],
    set_name: Annotated[str, Form(alias="name")],
) -> Status[dict[str, Any]]:
    """Import `file` (JSON Lines, one case a line: `name`, `inputs`, `expect`) as the next
    version of the model's set `name`, checked against the model's config: 201 with the new
    version. Refused whole (422) with every problem, each naming its line and field; the same
    cases as the latest version already: 200 with that version, nothing stored."""
    model = get_object_or_404(Model, name=name)
    if file.size is None or file.size > MAX_BYTES:
        message = f"larger than {MAX_BYTES // 2**20} MiB"
        raise QualityError([Problem(0, "file", message)])
    before = latest_set(model_id=model.pk, name=set_name)
    found = evaluation_set_import(
        model_name=model.name,
        name=set_name,
        text=file,  # its lines, as they are read
        actor=current_user(request),
        source=file.name or "",
    )
    return Status(200 if before == found else 201, _set_out(found, found.cases.count()))


@router.get("/evaluation-sets/{set_id}", response={200: EvaluationSetDetailOut, **ERRORS})
def get_evaluation_set(
    request: HttpRequest, set_id: int, offset: int = Offset, limit: int = Limit
) -> dict[str, Any]:
    """One version of a set: `limit` of its cases from `offset`, in the file's order."""
    found = get_object_or_404(EvaluationSet.objects.select_related("model"), pk=set_id)
    cases = found.cases.values("line", "name", "inputs", "expect")[offset : offset + limit]
    return {**_set_out(found, found.cases.count()), "items": list(cases)}


@router.post(
    "/evaluation-runs",
    response={202: RunOut, **ERRORS},
    auth=can("quality.add_evaluationrun", "evaluation.start"),
)
def start_evaluation_run(request: HttpRequest, body: RunIn) -> Status[dict[str, Any]]:
    """Queue a run: a worker sends the cases once this answers. Poll `links.self` until its
    status is done or failed. Refused (422) when a version is unknown or no node serves it."""
    model = get_object_or_404(Model, name=body.model)
    if body.set_version is None:
        evaluation_set = latest_set(model_id=model.pk, name=body.set)
    else:
        versions = EvaluationSet.objects.filter(model=model, name=body.set)
        evaluation_set = versions.filter(version=body.set_version).first()
    if evaluation_set is None:
        raise Http404(f"{model.name} has no evaluation set {body.set!r} of that version")
    node = get_object_or_404(Node, name=body.node) if body.node else None
    baseline_node = get_object_or_404(Node, name=body.baseline_node) if body.baseline_node else None
    run = evaluation_start(
        set_id=evaluation_set.pk,
        version=body.version,
        baseline_version=body.baseline_version,
        node=node,
        baseline_node=baseline_node,
        concurrency=body.concurrency,
        timeout_s=body.timeout_s,
        purpose=body.purpose,
        actor=current_user(request),
    )
    return Status(202, _run_out(get_object_or_404(run_list(), pk=run.pk)))


@router.get("/evaluation-runs/{run_id}", response={200: RunDetailOut, **ERRORS})
def get_evaluation_run(
    request: HttpRequest,
    run_id: int,
    only: Literal["failing", "changed"] | None = None,
    offset: int = Offset,
    limit: int = Limit,
) -> dict[str, Any]:
    """A run's status and scores, and `limit` of its cases from `offset` in the file's order,
    each with the version's answer beside the baseline's; `only` the failing ones, or those the
    two versions answered differently."""
    run = get_object_or_404(run_list(), pk=run_id)
    rows = run_rows(run, only=only or "", limit=offset + limit)[offset:]
    return {**_run_out(run), "cases": [_row_out(row) for row in rows]}


@router.get("/models/{name}/versions/{version}/quality", response={200: list[RunOut], **ERRORS})
def list_version_runs(
    request: HttpRequest, name: str, version: int, offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """The evaluation runs of that version, newest first, `limit` from `offset`, with their
    scores (and the baseline's, where the run had one)."""
    found = get_object_or_404(ModelVersion, model__name=name, version=version)
    runs = run_list(evaluation_set__model_id=found.model_id, version=version)
    return [_run_out(run) for run in runs[offset : offset + limit]]
