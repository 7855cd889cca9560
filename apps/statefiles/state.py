"""Each pool's desired state as its file says it, read from the database (a fixed number of
queries for every pool), checked in a file, and compared."""

import re
from collections import defaultdict
from typing import Any

from apps.degradation.models import Tiers
from apps.fleet.models import Deployment, NodePool
from apps.registry.models import ModelVersion
from apps.scaling.models import Scaling
from apps.statefiles.files import KEYS, TRAFFIC, Parsed, Problem

State = dict[str, Any]
POOL_NAME = re.compile(r"[-a-zA-Z0-9_]{1,60}")
FRESH = NodePool()  # a new pool's settings: what a file that leaves one out asks for
FRESH_SCALING = Scaling()


def defaults(pool: str) -> State:
    return {
        "pool": pool,
        "protected": FRESH.protected,
        "discoverable": FRESH.discoverable,
        "queue": FRESH.queue,
        "rollback_window_s": FRESH.rollback_window_s,
        "traffic": {
            "strategy": "none",
            "min_serving": FRESH.min_serving,
            "warmup_requests": FRESH.warmup_requests,
            "drain_timeout_s": FRESH.drain_timeout_s,
        },
        "scaling": {"least": FRESH_SCALING.least, "most": FRESH_SCALING.most},
        "deployments": [],
        "tiers": {},
    }


def read(pools: list[NodePool]) -> dict[str, State]:
    """The desired state of `pools`, as their files would say it. A pool on a tier below its
    primary is written at its primary: the step down is the automation's, not the team's."""
    ids = [pool.pk for pool in pools]
    tiers: dict[int, dict[str, list[int]]] = defaultdict(dict)
    for pool_id, model, versions in Tiers.objects.filter(pool_id__in=ids).values_list(
        "pool_id", "model__name", "versions"
    ):
        tiers[pool_id][model] = list(versions)
    deployments: dict[int, list[dict[str, Any]]] = defaultdict(list)
    rows = Deployment.objects.filter(pool_id__in=ids, node__isnull=True).order_by("model__name")
    for pool_id, model, version, standby in rows.values_list(
        "pool_id", "model__name", "version", "standby_version"
    ):
        primary = tiers[pool_id].get(model, [])
        entry = {"model": model, "version": primary[0] if version in primary else version}
        if standby is not None:
            entry["standby"] = standby
        deployments[pool_id].append(entry)
    scaling = {
        pool_id: {"least": least, "most": most}
        for pool_id, least, most in Scaling.objects.filter(pool_id__in=ids).values_list(
            "pool_id", "least", "most"
        )
    }
    found = {}
    for pool in pools:
        state = defaults(pool.name) | {
            "protected": pool.protected,
            "discoverable": pool.discoverable,
            "queue": pool.queue,
            "rollback_window_s": pool.rollback_window_s,
            "deployments": deployments[pool.pk],
            "tiers": dict(sorted(tiers[pool.pk].items())),
        }
        state["traffic"] |= {
            "min_serving": pool.min_serving,
            "warmup_requests": pool.warmup_requests,
            "drain_timeout_s": pool.drain_timeout_s,
        }
        if pool.traffic:
            state["traffic"] |= {
                "strategy": pool.traffic,
                "runtime": pool.traffic_runtime,
                "backends": pool.backend_entries,
            }
        state["scaling"] = scaling.get(pool.pk, state["scaling"])
        found[pool.name] = state
    return found


def checked(parsed: Parsed, releases: set[tuple[str, int]]) -> tuple[State, list[Problem]]:
    """The file's state with what it leaves out at a new pool's defaults, and every problem in
    it; `releases`: the registry's (model, version) pairs."""
    state, problems = parsed.state, []

    def problem(path: tuple[str | int, ...], message: str) -> None:
        problems.append(parsed.problem(path, message))

    name = state.get("pool")
    stem = parsed.file.rsplit("/", 1)[-1].removesuffix(".yaml")
    if not isinstance(name, str) or not POOL_NAME.fullmatch(name):
        problem(("pool",), "the pool's name: letters, digits, '-' and '_', at most 60")
        name = stem
    elif name != stem:
        problem(("pool",), f"pool {name} is written in {parsed.file}: name it {name}.yaml")
    for key in state.keys() - set(KEYS):
        problem((key,), f"not a setting of a pool (one of {', '.join(KEYS)})")
    full = defaults(name)
    for key, kind in [("protected", bool), ("discoverable", bool), ("queue", str)]:
        if key in state:
            if isinstance(state[key], kind):
                full[key] = state[key]
            else:
                problem(
                    (key,),
                    f"{'text' if kind is str else 'true or false'}, not {state[key]!r}",
                )
    if "rollback_window_s" in state:
        full["rollback_window_s"] = _count(
            state["rollback_window_s"], ("rollback_window_s",), problem
        )
    full["traffic"] = _traffic(state.get("traffic", {}), full["traffic"], problem)
    full["scaling"] = _scaling(state.get("scaling", {}), problem)
    full["deployments"] = _deployments(state.get("deployments", []), releases, problem)
    full["tiers"] = _tiers(state.get("tiers", {}), releases, problem)
    return full, problems


Report = Any  # the closure that records a problem at a path


def _count(value: Any, path: tuple[str | int, ...], problem: Report, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        problem(path, f"a whole number, {least} or more, not {value!r}")
        return least
    return value


def _mapping(
    value: Any, path: tuple[str | int, ...], keys: tuple[str, ...], problem: Report
) -> dict:
    if not isinstance(value, dict):
        problem(path, f"a mapping of {', '.join(keys)}, not {value!r}")
        return {}
    for key in value.keys() - set(keys):
        problem((*path, key), f"not one of {', '.join(keys)}")
    return value


def _traffic(value: Any, fresh: dict[str, Any], problem: Report) -> dict[str, Any]:
    given = _mapping(value, ("traffic",), TRAFFIC, problem)
    strategy = given.get("strategy", "none")
    if strategy not in ("none", *(t for t in NodePool.Traffic.values if t)):
        problem(("traffic", "strategy"), f"none or haproxy, not {strategy!r}")
        strategy = "none"
    traffic = dict(fresh, strategy=strategy)
    for key in ("min_serving", "warmup_requests", "drain_timeout_s"):
        if key in given:
            traffic[key] = _count(given[key], ("traffic", key), problem)
    if strategy == "none":
        for key in ("runtime", "backends"):
            if key in given:
                problem(("traffic", key), "only for a balancer (strategy: haproxy)")
        return traffic
    runtime, backends = given.get("runtime", ""), given.get("backends", [])
    if not isinstance(runtime, str) or not runtime:
        problem(("traffic", "runtime"), "HAProxy's runtime API: host:port or a socket's path")
    if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
        problem(("traffic", "backends"), "a list of HAProxy backend names")
        backends = []
    return traffic | {"runtime": runtime, "backends": backends}


def _scaling(value: Any, problem: Report) -> dict[str, Any]:
    given = _mapping(value, ("scaling",), ("least", "most"), problem)
    least = _count(given.get("least", FRESH_SCALING.least), ("scaling", "least"), problem)
    most = given.get("most")
    if most is not None:
        most = _count(most, ("scaling", "most"), problem, least=max(least, 1))
    return {"least": least, "most": most}


def _deployments(
    value: Any, releases: set[tuple[str, int]], problem: Report
) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        problem(("deployments",), "a list of {model, version[, standby]}")
        return []
    found: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(value):
        path = ("deployments", index)
        given = _mapping(entry, path, ("model", "version", "standby"), problem)
        model, version = given.get("model"), given.get("version")
        if not isinstance(model, str):
            problem((*path, "model"), "the model's name")
            continue
        if model in found:
            problem((*path, "model"), f"{model} is deployed twice")
        entry = {"model": model, "version": _count(version, (*path, "version"), problem, 1)}
        if "standby" in given:
            entry["standby"] = _count(given["standby"], (*path, "standby"), problem, 1)
        for key in ("version", "standby"):
            number = entry.get(key)
            if number is not None and (model, number) not in releases:
                problem((*path, key), f"{model} v{number} is not in the registry")
        found[model] = entry
    return sorted(found.values(), key=lambda entry: entry["model"])


def _tiers(value: Any, releases: set[tuple[str, int]], problem: Report) -> dict[str, list[int]]:
    if not isinstance(value, dict):
        problem(("tiers",), "a mapping of model to its tiers' versions, the primary first")
        return {}
    tiers = {}
    for model, versions in value.items():
        path = ("tiers", str(model))
        if not isinstance(versions, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in versions
        ):
            problem(path, f"versions, the primary first, such as [1, 4], not {versions!r}")
            continue
        for number in versions:
            if (str(model), number) not in releases:
                problem(path, f"{model} v{number} is not in the registry")
        tiers[str(model)] = versions
    return dict(sorted(tiers.items()))


def registry_releases() -> set[tuple[str, int]]:
    return set(ModelVersion.objects.values_list("model__name", "version"))


def differences(wanted: State, current: State | None) -> list[str]:
    """What differs, one line each, as the file would change the database."""
    pool = wanted["pool"]
    if current is None:
        return [f"pool {pool}: new", *differences(wanted, defaults(pool))]
    lines = []
    for key in ("protected", "discoverable", "queue", "rollback_window_s", "traffic", "scaling"):
        if wanted[key] != current[key]:
            lines.append(f"pool {pool}: {key} {_shown(current[key])} -> {_shown(wanted[key])}")
    now = {entry["model"]: entry for entry in current["deployments"]}
    then = {entry["model"]: entry for entry in wanted["deployments"]}
    for model in sorted(now.keys() | then.keys()):
        if now.get(model) != then.get(model):
            was, will = (_release(entry) for entry in (now.get(model), then.get(model)))
            lines.append(f"pool {pool}: deployment of {model} {was} -> {will}")
    for model in sorted(current["tiers"].keys() | wanted["tiers"].keys()):
        was, will = current["tiers"].get(model), wanted["tiers"].get(model)
        if was != will:
            kept = " (apply leaves them: nothing removes a pool's tiers)" if will is None else ""
            lines.append(f"pool {pool}: tiers of {model} {_shown(was)} -> {_shown(will)}{kept}")
    return lines


def _release(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none"
    standby = f" (v{entry['standby']} standing by)" if "standby" in entry else ""
    return f"v{entry['version']}{standby}"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, str):
        return repr(value)
    return str(value).lower() if isinstance(value, bool) else str(value)
