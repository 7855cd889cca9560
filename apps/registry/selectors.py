from typing import Any

from django.db.models import Count, Max, Q, QuerySet

from apps.registry.codec import from_dict, step_names
from apps.registry.ensembles import LATEST, Resolved, Resolver, pinned_steps
from apps.registry.models import Model, ModelVersion


def model_list(*, search: str = "", kind: str = "", team: str = "") -> QuerySet[Model]:
    models = Model.objects.annotate(
        version_count=Count("versions"), latest=Max("versions__version")
    )
    if search:
        models = models.filter(Q(name__icontains=search) | Q(description__icontains=search))
    if kind:
        models = models.filter(kind=kind)
    if team:
        models = models.filter(team=team)
    return models


def registry_resolver(overrides: dict[str, dict[int, Any]] | None = None) -> Resolver:
    """Resolves a step pin to a config: from `overrides` (models being imported or edited) first,
    then from the registry. -1 means the latest published version."""
    overrides = overrides or {}

    def resolve(name: str, version: int) -> Resolved:
        if name in overrides:
            configs = overrides[name]
            chosen = max(configs) if version == LATEST and configs else version
            if chosen in configs:
                return Resolved(configs[chosen], chosen)
            return Resolved(
                None, reason=f"model '{name}' has no version v{version} ({sorted(configs)})"
            )
        versions = ModelVersion.objects.filter(model__name=name)
        if version == LATEST:
            found = (
                versions.filter(status=ModelVersion.Status.PUBLISHED).order_by("-version").first()
            )
        else:
            found = versions.filter(version=version).first()
        if found is not None:
            return Resolved(from_dict(found.config), found.version)
        if not Model.objects.filter(name=name).exists():
            return Resolved(None, reason=f"model '{name}' is not in the registry")
        known = sorted(versions.values_list("version", flat=True))
        wanted = "a published version" if version == LATEST else f"version v{version}"
        return Resolved(None, reason=f"model '{name}' has no {wanted} (it has {known})")

    return resolve


def stored_steps(config: dict[str, Any]) -> dict[tuple[str, int], Any]:
    """(model, version) -> config of each step a stored ensemble config pins, resolved in the
    registry (`pinned_steps`); empty for any other model. Raises UnresolvedStep."""
    return pinned_steps(from_dict(config), registry_resolver())


def ensembles_using(model_name: str) -> list[ModelVersion]:
    """Every ensemble version with a step on `model_name`."""
    candidates = ModelVersion.objects.filter(model__kind=Model.Kind.ENSEMBLE).select_related(
        "model"
    )
    return [v for v in candidates if model_name in step_names(v.config)]


def next_version(model_name: str) -> int:
    """The number a new version of `model_name` gets unless it names its own."""
    versions = ModelVersion.objects.filter(model__name=model_name)
    return (versions.order_by("-version").values_list("version", flat=True).first() or 0) + 1
