"""Evaluation sets and runs: thin views over apps/quality/selectors.py and services.py."""

from typing import Any

from django.contrib import messages
from django.core.files.uploadedfile import UploadedFile
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.quality.cases import MAX_CASES, Problem
from apps.quality.errors import QualityError
from apps.quality.forms import KEPT_CHARS, RunForm, SetImportForm
from apps.quality.models import EvaluationCase, EvaluationSet
from apps.quality.selectors import (
    latest_done_run,
    latest_set,
    rule_text,
    run_list,
    run_rows,
    shown,
    shown_rows,
)
from apps.quality.selectors import set_list as select_sets
from apps.quality.services import evaluation_set_import, evaluation_start
from apps.registry.models import Model, ModelVersion
from apps.web.htmx import HtmxHttpRequest

FILTERS = {"": "All", "failing": "Failing", "changed": "Changed"}


def set_list(request: HttpRequest, name: str) -> HttpResponse:
    """A model's evaluation sets, newest first, and the form that imports one."""
    return _set_list(request, get_object_or_404(Model, name=name), SetImportForm())


def _set_list(
    request: HttpRequest,
    model: Model,
    form: SetImportForm,
    problems: list[Problem] | None = None,
    status: int = 200,
) -> HttpResponse:
    sets = select_sets(model_id=model.pk).order_by("-created_at", "-id")
    context = {
        "model": model,
        "page": Paginator(sets, 25).get_page(request.GET.get("page")),
        "form": form,
        "problems": problems or [],
    }
    return render(request, "quality/set_list.html", context, status=status)


@require_POST
@require("quality.add_evaluationset", "evaluation_set.import")
def set_import(request: HttpRequest, name: str) -> HttpResponse:
    """A JSON Lines file (or pasted cases) as the set's next version. A refused one comes back
    with every problem by line and field, its cases in the text box to be fixed there."""
    model = get_object_or_404(Model, name=name)
    form = SetImportForm(request.POST, request.FILES)
    if not form.is_valid():
        return _set_list(request, model, form, status=422)
    data = form.cleaned_data
    before = latest_set(model_id=model.pk, name=data["name"])
    try:
        found = evaluation_set_import(
            model_name=name,
            name=data["name"],
            text=data["file"] or data["text"],
            source=data["source"],
            actor=current_user(request),
        )
    except QualityError as exc:
        kept = _kept(data["file"]) if data["file"] else data["text"]
        kept = kept if len(kept) <= KEPT_CHARS else ""
        again = SetImportForm(initial={"name": data["name"], "text": kept})
        if data["source"] and not kept:
            messages.error(
                request, f"{data['source']} is too large to show: fix it, choose it again"
            )
        return _set_list(request, model, again, exc.problems, status=422)
    if before is not None and before.pk == found.pk:
        messages.success(request, f"{found.name} is unchanged: still v{found.version}.")
    else:
        messages.success(request, f"{found.name} v{found.version} imported.")
    return redirect("quality:set_detail", name=name, set_name=found.name, version=found.version)


def _kept(upload: UploadedFile) -> str:
    """A refused file, to be fixed in the text box, if it is small enough to show there."""
    if upload.size is None or upload.size > KEPT_CHARS:
        return ""
    upload.seek(0)
    return upload.read().decode("utf-8-sig", errors="replace")


def _set(name: str, set_name: str, version: int) -> EvaluationSet:
    found = EvaluationSet.objects.select_related("model")
    return get_object_or_404(found, model__name=name, name=set_name, version=version)


def set_detail(request: HttpRequest, name: str, set_name: str, version: int) -> HttpResponse:
    found = _set(name, set_name, version)
    return _set_page(request, found, RunForm(versions=_versions(found.model)))


def _versions(model: Model) -> list[int]:
    return list(model.versions.order_by("-version").values_list("version", flat=True))


def _set_page(
    request: HttpRequest, found: EvaluationSet, form: RunForm, error: str = "", status: int = 200
) -> HttpResponse:
    cases = Paginator(found.cases.all(), 25).get_page(request.GET.get("page"))
    runs = Paginator(run_list(evaluation_set=found), 10).get_page(request.GET.get("runs"))
    others = EvaluationSet.objects.filter(model=found.model, name=found.name).exclude(pk=found.pk)
    context = {
        "set": found,
        "model": found.model,
        "cases": cases,
        "case_rows": [_case_row(case) for case in cases],
        "runs": runs,
        "others": others.order_by("-version").values_list("version", flat=True)[:10],
        "form": form,
        "error": error,
        # Each pager keeps the other's page.
        "cases_query": _keep(request, "runs"),
        "runs_query": _keep(request, "page"),
    }
    return render(request, "quality/set_detail.html", context, status=status)


def _keep(request: HttpRequest, param: str) -> str:
    return urlencode({param: request.GET[param]}) if request.GET.get(param) else ""


def _case_row(case: EvaluationCase) -> dict[str, Any]:
    return {
        "case": case,
        "inputs": [(key, shown(value)) for key, value in case.inputs.items()],
        "rules": [(output, rule_text(rule)) for output, rule in case.expect.items()],
    }


@require_POST
@require("quality.add_evaluationrun", "evaluation.start")
def run_start(request: HttpRequest, name: str, set_name: str, version: int) -> HttpResponse:
    found = _set(name, set_name, version)
    form = RunForm(request.POST, versions=_versions(found.model))
    error = ""
    if form.is_valid():
        try:
            run = evaluation_start(
                set_id=found.pk,
                version=form.cleaned_data["version"],
                baseline_version=form.cleaned_data["baseline_version"],
                actor=current_user(request),
            )
        except QualityError as exc:
            error = str(exc)
        else:
            messages.success(request, f"Evaluation run #{run.pk} queued.")
            return redirect("quality:run_detail", pk=run.pk)
    return _set_page(request, found, form, error, status=422)


def run_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """A run: its scores, then every case with both answers side by side; htmx polling gets
    the live part while it is queued or running, and HTTP 286 stops it once finished."""
    run = get_object_or_404(run_list(), pk=pk)
    only = request.GET.get("only", "")
    only = only if only in FILTERS else ""
    rows = run_rows(run, limit=MAX_CASES)
    counts = {"": len(rows), "failing": sum(r.failing for r in rows)}
    counts["changed"] = sum(r.changed for r in rows)
    if only:
        rows = [r for r in rows if (r.failing if only == "failing" else r.changed)]
    page = Paginator(rows, 50).get_page(request.GET.get("page"))
    context = {
        "run": run,
        "only": only,
        "filters": [(key, label, counts[key]) for key, label in FILTERS.items()],
        "page": page,
        "rows": shown_rows(page),
        "query": urlencode({"only": only}) if only else "",
        "took_s": (run.finished_at - run.started_at).total_seconds()
        if run.finished_at and run.started_at
        else None,
    }
    if request.htmx and request.htmx.target == "run-live":
        response = render(request, "quality/run_detail.html#run-live", context)
        response.status_code = 286 if run.finished else 200
        return response
    return render(request, "quality/run_detail.html", context)


def version_quality(request: HttpRequest, name: str, version: int) -> HttpResponse:
    """A version's score history, whatever the set, and the failing cases of its latest run."""
    found = get_object_or_404(
        ModelVersion.objects.select_related("model"), model__name=name, version=version
    )
    runs = run_list(evaluation_set__model=found.model, version=version)
    latest = latest_done_run(model_id=found.model_id, version=version)
    failing = run_rows(latest, only="failing", limit=50) if latest else []
    context = {
        "version": found,
        "model": found.model,
        "page": Paginator(runs, 25).get_page(request.GET.get("page")),
        "latest": latest,
        "rows": shown_rows(failing, judged_only=True),
    }
    return render(request, "quality/version_quality.html", context)
