"""Models and versions: list, get, create (pbtxt or JSON), validate without storing, diff,
release, and import of a repository layout."""

from datetime import datetime
from typing import Any, Literal

from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from google.protobuf.json_format import ParseError
from ninja import File, Form, Router, Schema, Status
from ninja.files import UploadedFile

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, ApiError
from apps.api.paging import Limit, Offset
from apps.registry.archives import ArchiveError
from apps.registry.codec import from_dict, to_pbtxt
from apps.registry.diff import config_diff
from apps.registry.imports import archive_import
from apps.registry.models import Model, ModelVersion
from apps.registry.services import (
    RegistryError,
    compatibility_breaks,
    config_parse,
    config_problems,
    version_create,
    version_set_status,
)
from apps.registry.validation import Problem, errors

router = Router(tags=["registry"], auth=Token())


class VersionSummary(Schema):
    version: int
    status: str
    created_at: datetime


class ModelOut(Schema):
    name: str
    kind: str
    backend: str
    team: str
    latency_budget_ms: int | None
    slo_availability: float | None
    slo_latency: float | None
    fallback_version: int | None
    versions: list[VersionSummary]


class VersionOut(Schema):
    model: str
    version: int
    status: str
    config: dict[str, Any]
    pbtxt: str
    artifact: str
    checksum: str
    notes: str
    created_at: datetime


class ConfigIn(Schema):
    """A config as Triton reads it: `pbtxt` (config.pbtxt text) or `config` (its JSON form)."""

    pbtxt: str | None = None
    config: dict[str, Any] | None = None


class VersionIn(ConfigIn):
    version: int | None = None
    artifact: str = ""
    checksum: str = ""
    notes: str = ""


class ProblemOut(Schema):
    level: str
    model: str
    field: str
    message: str


class ValidationOut(Schema):
    valid: bool
    problems: list[ProblemOut]
    breaks: dict[str, list[ProblemOut]]  # "ensemble vN" -> what the change would break in it


class StatusIn(Schema):
    status: Literal["draft", "published", "deprecated"]


class DiffRow(Schema):
    kind: str
    left_no: int | None
    left: str
    right_no: int | None
    right: str


class DiffOut(Schema):
    model: str
    left: int
    right: int
    rows: list[DiffRow]


class ImportOut(Schema):
    model: str
    versions: list[int]
    ok: bool
    errors: list[str]


def _problems(problems: list[Problem]) -> list[dict[str, str]]:
    return [vars(p) for p in problems]


def _invalid(problems: list[Problem]) -> ApiError:
    return ApiError(422, "invalid_config", "; ".join(map(str, problems)), _problems(problems))


def _config(name: str, body: ConfigIn) -> Any:
    """The config a caller sent, or a 422 that says where it is wrong (line and column for pbtxt,
    the field for JSON), as the registry pages do."""
    if (body.pbtxt is None) == (body.config is None):
        raise ApiError(422, "invalid_request", "send the config as `pbtxt` or as `config`, once")
    if body.pbtxt is not None:
        config, problems = config_parse(body.pbtxt, model_name=name)
        if config is None:
            raise _invalid(problems)
        return config
    try:
        return from_dict(body.config or {})
    except ParseError as exc:
        raise _invalid([Problem("error", name, "config", str(exc))]) from None


def _model_out(model: Model) -> dict[str, Any]:
    return {
        **{f: getattr(model, f) for f in ("name", "kind", "backend", "team")},
        **{f: getattr(model, f) for f in ("latency_budget_ms", "slo_availability", "slo_latency")},
        "fallback_version": model.fallback_version,
        "versions": [
            {"version": v.version, "status": v.status, "created_at": v.created_at}
            for v in model.versions.all()
        ],
    }


def _version_out(found: ModelVersion) -> dict[str, Any]:
    return {
        "model": found.model.name,
        "pbtxt": to_pbtxt(from_dict(found.config)),
        **{
            f: getattr(found, f)
            for f in ("version", "status", "config", "artifact", "checksum", "notes", "created_at")
        },
    }


def _version(name: str, number: int) -> ModelVersion:
    return get_object_or_404(
        ModelVersion.objects.select_related("model"), model__name=name, version=number
    )


@router.get("/models", response={200: list[ModelOut], **ERRORS})
def list_models(
    request: HttpRequest, search: str = "", offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """Models by name, `limit` from `offset`, each with its versions."""
    found = _models().filter(name__icontains=search).order_by("name")
    return [_model_out(model) for model in found[offset : offset + limit]]


@router.get("/models/{name}", response={200: ModelOut, **ERRORS})
def get_model(request: HttpRequest, name: str) -> dict[str, Any]:
    return _model_out(get_object_or_404(_models(), name=name))


def _models() -> QuerySet[Model]:
    """With their versions' numbers and statuses (not their configs)."""
    listed = ModelVersion.objects.only("model_id", "version", "status", "created_at")
    return Model.objects.prefetch_related(Prefetch("versions", queryset=listed))


@router.get("/models/{name}/versions/{version}", response={200: VersionOut, **ERRORS})
def get_version(request: HttpRequest, name: str, version: int) -> dict[str, Any]:
    return _version_out(_version(name, version))


@router.post(
    "/models/{name}/versions",
    response={201: VersionOut, **ERRORS},
    auth=can("registry.add_modelversion", "version.create"),
)
def register_version(request: HttpRequest, name: str, body: VersionIn) -> Status[dict[str, Any]]:
    """Register a version (a draft) of `name`, a new model if it is the first. Refused with every
    problem when Triton would refuse the config."""
    if body.version is not None and body.version < 1:
        raise ApiError(422, "invalid_request", "version: a version number starts at 1")
    try:
        created = version_create(
            model_name=name,
            config=_config(name, body),
            actor=current_user(request),
            version=body.version,
            artifact=body.artifact,
            checksum=body.checksum,
            notes=body.notes,
        )
    except RegistryError as exc:
        raise _invalid(exc.problems) from None
    return Status(201, _version_out(created))


@router.post(
    "/models/{name}/validate",
    response={200: ValidationOut, **ERRORS},
)
def validate_config(request: HttpRequest, name: str, body: ConfigIn) -> dict[str, Any]:
    """Validate a config for `name` as the registry would, storing nothing: its problems, and
    what it would break in the ensembles that use `name`."""
    try:
        config = _config(name, body)
    except ApiError as exc:
        if exc.code != "invalid_config":
            raise
        return {"valid": False, "problems": exc.details, "breaks": {}}
    problems = config_problems(config, expected_name=name)
    breaks = {} if errors(problems) else compatibility_breaks(model_name=name, config=config)
    return {
        "valid": not errors(problems) and not breaks,
        "problems": _problems(problems),
        "breaks": {
            f"{b.ensemble.model.name} v{b.ensemble.version}": _problems(b.problems) for b in breaks
        },
    }


@router.post(
    "/models/{name}/versions/{version}/status",
    response={200: VersionOut, **ERRORS},
    auth=can("registry.change_modelversion", "version.set_status"),
)
def set_version_status(
    request: HttpRequest, name: str, version: int, body: StatusIn
) -> dict[str, Any]:
    """Publish (or deprecate) a version: only published versions deploy."""
    found = _version(name, version)
    try:
        version_set_status(version_id=found.pk, status=body.status, actor=current_user(request))
    except RegistryError as exc:
        raise ApiError(409, "refused", str(exc), _problems(exc.problems)) from None
    return _version_out(_version(name, version))


@router.get("/models/{name}/diff", response={200: DiffOut, **ERRORS})
def diff_versions(request: HttpRequest, name: str, left: int, right: int) -> dict[str, Any]:
    """Line by line, the canonical config.pbtxt of two versions."""
    a, b = _version(name, left), _version(name, right)
    rows = config_diff(a.config, b.config)
    return {"model": name, "left": left, "right": right, "rows": [vars(row) for row in rows]}


@router.post(
    "/import",
    response={200: list[ImportOut], **ERRORS},
    auth=can("registry.add_modelversion", "registry.import"),
)
def import_repository(
    request: HttpRequest, archive: File[UploadedFile], dry_run: Form[bool] = False
) -> list[dict[str, Any]]:
    """Import a Triton model repository layout (`<model>/config.pbtxt`, `<model>/<version>/`),
    sent as a zip archive: every version Triton would accept, and each model's problems."""
    try:
        results = archive_import(archive=archive, actor=current_user(request), dry_run=dry_run)
    except ArchiveError as exc:
        raise ApiError(422, "invalid_archive", str(exc)) from None
    return [result.as_json() for result in results]
