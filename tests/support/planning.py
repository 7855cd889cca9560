"""Desired and observed states for planner tests, written short."""

from apps.fleet.desired import DesiredModel, with_versions
from apps.fleet.planner import Action, Observed

CONFIG = {"name": "m", "backend": "python", "max_batch_size": 8}


def desired(name: str, *versions: int, ensemble: bool = False) -> DesiredModel:
    config = with_versions({**CONFIG, "name": name}, list(versions))
    if ensemble:
        config["ensemble_scheduling"] = {"step": [{"model_name": "step", "model_version": -1}]}
    return DesiredModel(name, versions, config, ensemble, depth=1 if ensemble else 0)


def ready(
    *versions: int, digest: str = "", busy: bool = False, failed: tuple[str, ...] = ()
) -> Observed:
    return Observed(frozenset(versions), busy=busy, digest=digest, failed=frozenset(failed))


def kinds(actions: list[Action]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(a.kind, a.model, a.versions) for a in actions]


MANAGED = {"step": False, "pipe": True, "old": False, "oldpipe": True}
