"""Every write to the registry: transactional, validated first, audited."""

from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User

from apps.audit.services import Actor, audit_record, audited, fields_set
from apps.registry.codec import ConfigSyntaxError, from_dict, parse_pbtxt, to_dict
from apps.registry.ensembles import Resolver, validate_ensemble
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import ensembles_using, next_version, registry_resolver
from apps.registry.validation import Problem, errors, is_ensemble, validate_config


class RegistryError(Exception):
    """The change was refused; nothing was stored. `problems` say what and where."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def config_parse(
    text: str, *, model_name: str = "", source: str = "config.pbtxt"
) -> tuple[Any | None, list[Problem]]:
    """Parse a config.pbtxt: the config, or None and the syntax error with its line and column."""
    try:
        return parse_pbtxt(text, source=source), []
    except ConfigSyntaxError as exc:
        where = f"line {exc.line}, column {exc.column}"
        return None, [Problem("error", model_name or source, where, exc.args[0].split(": ", 1)[-1])]


def config_check(
    text: str, *, model_name: str = "", source: str = "config.pbtxt"
) -> tuple[Any | None, list[Problem]]:
    """Parse and validate a config.pbtxt: the config (None on a syntax error) and every problem."""
    config, problems = config_parse(text, model_name=model_name, source=source)
    if config is None:
        return None, problems
    return config, config_problems(config, expected_name=model_name)


def config_problems(
    config: Any, *, expected_name: str = "", resolve: Resolver | None = None
) -> list[Problem]:
    problems = validate_config(config, expected_name=expected_name)
    if is_ensemble(config) and not errors(problems):
        problems += validate_ensemble(config, resolve or registry_resolver())
    return problems


@dataclass(frozen=True)
class Break:
    ensemble: ModelVersion
    problems: list[Problem] = field(default_factory=list)


def compatibility_breaks(*, model_name: str, config: Any) -> list[Break]:
    """Ensemble versions whose wiring `config` would break if their `model_name` step pinned it."""
    breaks = []
    for ensemble in ensembles_using(model_name):
        ensemble_config = from_dict(ensemble.config)
        for step in ensemble_config.ensemble_scheduling.step:
            if step.model_name == model_name:
                step.model_version = 0  # stands for "the new version"
        resolve = registry_resolver({model_name: {0: config}})
        problems = errors(validate_ensemble(ensemble_config, resolve))
        if problems:
            breaks.append(Break(ensemble, problems))
    return breaks


def _model_target(*, model_name: str, **_: object) -> str:
    return f"model:{model_name}"


def _version_target(*, version_id: int, **_: object) -> str:
    found = ModelVersion.objects.filter(pk=version_id).select_related("model").first()
    return f"model:{found.model.name}:v{found.version}" if found else f"version:{version_id}"


@audited("version.create", _model_target, (RegistryError,))
def version_create(
    *,
    model_name: str,
    config: Any,
    actor: Actor,
    version: int | None = None,
    artifact: str = "",
    checksum: str = "",
    notes: str = "",
    status: str = ModelVersion.Status.DRAFT,
    resolve: Resolver | None = None,
) -> ModelVersion:
    """Register a new version; refuses (storing nothing) when Triton would refuse the config."""
    problems = config_problems(config, expected_name=model_name, resolve=resolve)
    if errors(problems):
        raise RegistryError(problems)
    kind = Model.Kind.ENSEMBLE if is_ensemble(config) else Model.Kind.STANDALONE
    model, _ = Model.objects.get_or_create(
        name=model_name, defaults={"kind": kind, "backend": config.backend or config.platform}
    )
    if model.kind != kind:
        raise RegistryError(
            [Problem("error", model_name, "platform", f"{model_name} is a {model.kind} model")]
        )
    number = version if version is not None else next_version(model_name)
    if model.versions.filter(version=number).exists():
        raise RegistryError(
            [
                Problem(
                    "error",
                    model_name,
                    "version",
                    f"v{number} already exists; versions are immutable",
                )
            ]
        )
    created = ModelVersion.objects.create(
        model=model,
        version=number,
        config=to_dict(config),
        artifact=artifact,
        checksum=checksum,
        notes=notes,
        status=status,
        author=actor if isinstance(actor, User) else None,
    )
    audit_record(
        actor=actor,
        target=f"model:{model_name}:v{number}",
        after={"status": status, "artifact": artifact},
    )
    return created


_TRANSITIONS = {
    ModelVersion.Status.DRAFT: {ModelVersion.Status.PUBLISHED, ModelVersion.Status.DEPRECATED},
    ModelVersion.Status.PUBLISHED: {ModelVersion.Status.DEPRECATED},
    ModelVersion.Status.DEPRECATED: set(),
}


@audited("version.set_status", _version_target, (RegistryError,))
def version_set_status(*, version_id: int, status: str, actor: Actor) -> ModelVersion:
    version = ModelVersion.objects.select_for_update().select_related("model").get(pk=version_id)
    if status not in _TRANSITIONS[ModelVersion.Status(version.status)]:
        raise RegistryError(
            [
                Problem(
                    "error",
                    version.model.name,
                    "status",
                    f"v{version.version} cannot go from {version.status} to {status}",
                )
            ]
        )
    before = version.status
    version.status = status
    version.save(update_fields=["status"])
    audit_record(
        actor=actor,
        target=f"model:{version.model.name}:v{version.version}",
        before={"status": before},
        after={"status": status},
    )
    return version


@audited("model.set_budget", _model_target, (RegistryError,))
def model_set_budget(*, model_name: str, latency_budget_ms: int | None, actor: Actor) -> Model:
    model = _model_locked(model_name)
    values = {"latency_budget_ms": latency_budget_ms}
    fields_set(model, values, actor=actor, target=f"model:{model_name}")
    return model


@audited("model.set_fallback", _model_target, (RegistryError,))
def model_set_fallback(*, model_name: str, version: int | None, actor: Actor) -> Model:
    """The version on-call switches a pool to in a latency emergency; it must be published."""
    model = _model_locked(model_name)
    published = model.versions.filter(status=ModelVersion.Status.PUBLISHED)
    if version is not None and not published.filter(version=version).exists():
        problem = Problem("error", model_name, "fallback_version", f"v{version} is not published")
        raise RegistryError([problem])
    fields_set(model, {"fallback_version": version}, actor=actor, target=f"model:{model_name}")
    return model


@audited("model.set_slo", _model_target, (RegistryError,))
def model_set_slo(
    *,
    model_name: str,
    availability: float | None,
    latency: float | None,
    actor: Actor,
    ttft: tuple[float, int] | None = None,
) -> Model:
    """The model's service level objectives, each a share of requests between 0 and 1 (None: no
    objective); a latency objective is held to the model's latency budget, so it needs one; a
    first-token objective (an LLM's) is a share and the milliseconds its first tokens must come
    within."""
    model = _model_locked(model_name)
    share, within_ms = ttft or (None, None)
    problems = [
        Problem("error", model_name, f"slo_{name}", f"{value!r} is not a share between 0 and 1")
        for name, value in [("availability", availability), ("latency", latency), ("ttft", share)]
        if value is not None and not 0 < value < 1
    ]
    if latency is not None and model.latency_budget_ms is None:
        why = "a latency objective needs a latency budget (set_budgets) to be held to"
        problems.append(Problem("error", model_name, "slo_latency", why))
    if within_ms is not None and within_ms < 1:
        why = f"{within_ms!r} ms is no time to first token"
        problems.append(Problem("error", model_name, "slo_ttft_ms", why))
    if problems:
        raise RegistryError(problems)
    values = {"slo_availability": availability, "slo_latency": latency}
    values |= {"slo_ttft": share, "slo_ttft_ms": within_ms}
    fields_set(model, values, actor=actor, target=f"model:{model_name}")
    return model


@audited("version.set_memory", _model_target, (RegistryError,))
def version_set_memory(
    *, model_name: str, version: int, memory_mb: int | None, actor: Actor
) -> ModelVersion:
    """A version's declared memory estimate, which memory-aware loads use until its footprint
    is measured (None: none)."""
    found = ModelVersion.objects.select_for_update().filter(model__name=model_name, version=version)
    row = found.first()
    if row is None:
        raise RegistryError([Problem("error", model_name, "version", f"no v{version}")])
    if memory_mb is not None and memory_mb < 1:
        raise RegistryError(
            [Problem("error", model_name, "memory_mb", f"{memory_mb} MiB is not an estimate")]
        )
    fields_set(row, {"memory_mb": memory_mb}, actor=actor, target=f"model:{model_name}:v{version}")
    return row


def _model_locked(name: str) -> Model:
    model = Model.objects.select_for_update().filter(name=name).first()
    if model is None:
        raise RegistryError([Problem("error", name, "model", f"no model named {name!r}")])
    return model
