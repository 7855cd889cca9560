"""Desired state per node, from the deployments that target its pool or the node itself."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.db.models import Q

from apps.fleet.models import Deployment, Node
from apps.registry.codec import ensemble_steps, from_dict, pin_versions, to_dict
from apps.registry.models import ModelVersion
from apps.registry.selectors import registry_resolver
from apps.registry.validation import is_ensemble


def digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def with_versions(config: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    return to_dict(pin_versions(from_dict(config), versions))


@dataclass(frozen=True)
class DesiredModel:
    name: str
    versions: tuple[int, ...]
    config: dict[str, Any]  # the load request's config override, version policy included
    ensemble: bool
    depth: int = 0  # 0 for a model, 1 + its deepest step for an ensemble: load in this order

    @property
    def digest(self) -> str:
        return digest(self.config)


class DesiredStateError(Exception):
    """A deployment that cannot be turned into loads (a version or a step is missing)."""


def node_desired(node: Node) -> dict[str, DesiredModel]:
    targeting = Deployment.objects.filter(Q(pool_id=node.pool_id) | Q(node=node))
    # A node-level deployment wins over the pool's for the same model.
    deployments = {
        d.model.name: d
        for d in sorted(targeting.select_related("model"), key=lambda d: d.node_id is not None)
    }
    wanted: dict[str, dict[int, Any]] = {}  # model -> version -> config
    resolve = registry_resolver()
    for name, deployment in deployments.items():
        numbers = [v for v in (deployment.version, deployment.baseline_version) if v]
        found = ModelVersion.objects.filter(model__name=name, version__in=numbers)
        configs = {v.version: from_dict(v.config) for v in found}
        missing = [v for v in numbers if v not in configs]
        if missing:
            raise DesiredStateError(f"{deployment}: {name} v{missing[0]} is not in the registry")
        wanted.setdefault(name, {}).update(configs)
        pending = [step for config in configs.values() for step in ensemble_steps(config)]
        while pending:  # nested ensembles bring their own steps
            step, pinned = pending.pop()
            resolved = resolve(step, pinned)
            if resolved.config is None or resolved.version is None:
                raise DesiredStateError(f"{deployment}: {resolved.reason}")
            if resolved.version not in wanted.setdefault(step, {}):
                wanted[step][resolved.version] = resolved.config
                pending += ensemble_steps(resolved.config)

    def depth(name: str) -> int:
        steps = [s for config in wanted[name].values() for s, _ in ensemble_steps(config)]
        return 1 + max(map(depth, steps)) if steps else 0  # validation rules out cycles

    desired = {}
    for name, configs in wanted.items():
        # Triton keeps one config per model: the newest wanted version's config serves them all.
        versions = sorted(configs)
        config = to_dict(pin_versions(configs[versions[-1]], versions))
        ensemble = is_ensemble(configs[versions[-1]])
        desired[name] = DesiredModel(name, tuple(versions), config, ensemble, depth(name))
    return desired


def plan_digest(desired: dict[str, DesiredModel]) -> str:
    return digest({name: model.config for name, model in sorted(desired.items())})
