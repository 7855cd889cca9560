from pathlib import Path

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.permissions import current_user, require
from apps.registry.archives import ArchiveError, release_archive
from apps.registry.codec import (
    ensemble_steps,
    from_dict,
    int_parameter,
    to_pbtxt,
    without_version_policy,
)
from apps.registry.dag import ensemble_graph
from apps.registry.diff import config_diff
from apps.registry.ensembles import UnresolvedStep, pinned_steps, streams
from apps.registry.forms import ImportForm, VersionForm
from apps.registry.highlight import highlight_pbtxt
from apps.registry.imports import archive_import
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import model_list as select_models
from apps.registry.selectors import registry_resolver
from apps.registry.services import (
    RegistryError,
    compatibility_breaks,
    config_check,
    config_parse,
    config_problems,
    version_create,
    version_set_status,
)
from apps.registry.validation import errors
from apps.web.guard import takes_post
from apps.web.htmx import HtmxHttpRequest


def model_list(request: HttpRequest) -> HttpResponse:
    filters = {key: request.GET.get(key, "").strip() for key in ("search", "kind", "team")}
    context = {
        "models": select_models(**filters),
        "filters": filters,
        "kinds": Model.Kind.choices,
        "teams": Model.objects.exclude(team="").values_list("team", flat=True).distinct(),
        "import_form": ImportForm(),
    }
    return render(request, "registry/model_list.html", context)


def _version(name: str, version: int) -> ModelVersion:
    return get_object_or_404(
        ModelVersion.objects.select_related("model", "author"), model__name=name, version=version
    )


def _budgets(config: object) -> dict[str, int | None]:
    names = [model for model, _ in ensemble_steps(config)]
    return dict(Model.objects.filter(name__in=names).values_list("name", "latency_budget_ms"))


def model_detail(request: HttpRequest, name: str) -> HttpResponse:
    model = get_object_or_404(Model, name=name)
    versions = list(model.versions.select_related("author"))
    context: dict[str, object] = {"model": model, "versions": versions}
    if model.kind == Model.Kind.ENSEMBLE and versions:
        config = from_dict(versions[0].config)
        context["graph"] = ensemble_graph(config, _budgets(config))
        context["graph_version"] = versions[0]
    return render(request, "registry/model_detail.html", context)


def version_detail(request: HttpRequest, name: str, version: int) -> HttpResponse:
    found = _version(name, version)
    config = from_dict(found.config)
    context: dict[str, object] = {
        "version": found,
        "pbtxt": highlight_pbtxt(to_pbtxt(config)),
        "problems": config_problems(config, expected_name=name),
        "others": found.model.versions.exclude(pk=found.pk).values_list("version", flat=True),
        "streams": streams(config, registry_resolver()),
        "max_tokens": int_parameter(config, "max_tokens"),
    }
    if found.model.kind == Model.Kind.ENSEMBLE:
        context["graph"] = ensemble_graph(config, _budgets(config))
    return render(request, "registry/version_detail.html", context)


def version_config(request: HttpRequest, name: str, version: int) -> HttpResponse:
    found = _version(name, version)
    response = HttpResponse(
        to_pbtxt(from_dict(found.config)), content_type="text/plain; charset=utf-8"
    )
    response["Content-Disposition"] = f'attachment; filename="{name}-v{version}-config.pbtxt"'
    return response


@require("fleet.operate_node", "registry.download")
@require_GET
def version_archive(request: HttpRequest, name: str, version: int) -> HttpResponseBase:
    """The repository layout of a release: the version and, for an ensemble, its pinned steps;
    for the roles that may deploy it (its files are the model's weights and code)."""
    found = _version(name, version)
    config = from_dict(found.config)
    members = [(name, version, config, found.artifact)]
    try:
        steps = pinned_steps(config, registry_resolver())
    except UnresolvedStep as exc:
        raise Http404(str(exc)) from None
    for (step, number), step_config in steps.items():
        artifact = ModelVersion.objects.get(model__name=step, version=number).artifact
        members.append((step, number, step_config, artifact))
    roots = [Path(root) for root in settings.REGISTRY_ARTIFACT_ROOTS]
    try:
        chunks = release_archive(members, roots=roots)
    except ArchiveError as exc:
        messages.error(request, f"{name} v{version}: {exc}")
        return redirect("registry:version_detail", name, version)
    response = StreamingHttpResponse(chunks, content_type="application/zip")
    response["Content-Disposition"] = f'attachment; filename="{name}-v{version}-repository.zip"'
    return response


def version_diff(request: HttpRequest, name: str) -> HttpResponse:
    model = get_object_or_404(Model, name=name)
    numbers = list(model.versions.values_list("version", flat=True))
    try:
        a = int(request.GET.get("a") or min(numbers))
        b = int(request.GET.get("b") or max(numbers))
    except ValueError:
        a, b = min(numbers, default=0), max(numbers, default=0)
    left, right = _version(name, a), _version(name, b)
    rows = config_diff(left.config, right.config)
    return render(
        request,
        "registry/version_diff.html",
        {"model": model, "left": left, "right": right, "rows": rows, "numbers": numbers},
    )


@require("registry.add_modelversion", "version.create")
def version_new(request: HttpRequest, name: str) -> HttpResponse:
    model = get_object_or_404(Model, name=name)
    if request.method == "POST":
        form = VersionForm(request.POST)
        if form.is_valid():
            # Parsed here, validated once by the service, which refuses with every problem.
            config, problems = config_parse(form.cleaned_data["pbtxt"], model_name=name)
            if config is not None:
                try:
                    created = version_create(
                        model_name=name,
                        config=config,
                        actor=current_user(request),
                        artifact=form.cleaned_data["artifact"],
                        notes=form.cleaned_data["notes"],
                    )
                except RegistryError as exc:
                    problems = exc.problems
                else:
                    messages.success(request, f"{name} v{created.version} registered as a draft.")
                    return redirect("registry:version_detail", name=name, version=created.version)
            return render(
                request,
                "registry/version_new.html",
                {"model": model, "form": form, "problems": problems},
                status=422,
            )
    else:
        source = (
            model.versions.filter(version=request.GET.get("from") or 0).first()
            or model.versions.first()
        )
        initial = {
            "pbtxt": to_pbtxt(without_version_policy(from_dict(source.config))) if source else ""
        }
        form = VersionForm(initial=initial)
    return render(request, "registry/version_new.html", {"model": model, "form": form})


@takes_post  # a dry run: it changes nothing
@require_POST
def version_validate(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Inline validation as the user types: problems, and the ensembles the change would break."""
    text = request.POST.get("pbtxt", "")[:200_000]
    config, problems = config_check(text, model_name=name)
    breaks = []
    if config is not None and not errors(problems):
        breaks = compatibility_breaks(model_name=name, config=config)
    return render(
        request,
        "registry/partials/problems.html",
        {"problems": problems, "breaks": breaks, "checked": True},
    )


@require_POST
@require("registry.change_modelversion", "version.set_status")
def version_status(request: HttpRequest, name: str, version: int) -> HttpResponse:
    found = _version(name, version)
    try:
        version_set_status(
            version_id=found.pk, status=request.POST.get("status", ""), actor=current_user(request)
        )  # type: ignore[arg-type]
    except (RegistryError, ValueError) as exc:
        messages.error(request, str(exc))
    return redirect("registry:version_detail", name=name, version=version)


@require_POST
@require("registry.add_modelversion", "registry.import")
def repository_upload(request: HttpRequest) -> HttpResponse:
    form = ImportForm(request.POST, request.FILES)
    results, error, dry_run = [], "", False
    if not form.is_valid():
        error = "; ".join(f"{k}: {' '.join(map(str, v))}" for k, v in form.errors.items())
    else:
        dry_run = form.cleaned_data["dry_run"]
        try:
            results = archive_import(
                archive=form.cleaned_data["archive"], actor=current_user(request), dry_run=dry_run
            )
        except ArchiveError as exc:
            error = str(exc)
    status = 422 if error or any(not r.ok for r in results) else 200
    return render(
        request,
        "registry/import_result.html",
        {"results": results, "error": error, "dry_run": dry_run},
        status=status,
    )
