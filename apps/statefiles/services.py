"""Files in, the database made to match them: through the services a person uses, so every
rule holds as it does on the pages (a pool's owner, approvals on a protected pool, a version's
status), and audited as one change naming the files' commit."""

from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User

from apps.accounts.permissions import ApprovalRequired, authorize
from apps.approvals.services import approval_request
from apps.audit.services import Actor, audit_record, audited
from apps.degradation.services import TierError, tiers_set
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, NodePool
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.pools import (
    pool_set_discoverable,
    pool_set_protected,
    pool_set_queue,
    pool_set_rollback_window,
    pool_set_traffic,
)
from apps.scaling.services import ScalingError, scaling_set
from apps.statefiles.files import FilesError, Parsed, Problem, load
from apps.statefiles.state import State, checked, defaults, differences, read, registry_releases


@dataclass
class Plan:
    """Files read and checked, beside the database's state of their pools."""

    parsed: dict[str, Parsed]  # by pool
    wanted: dict[str, State]
    current: dict[str, State]
    elsewhere: list[str]  # pools in the database that no file names

    def differences(self) -> list[str]:
        lines = [
            line
            for pool, state in self.wanted.items()
            for line in differences(state, self.current.get(pool))
        ]
        return lines + [f"pool {pool}: in no file (apply leaves it)" for pool in self.elsewhere]


def plan(files: dict[str, str]) -> Plan:
    """Every file read and checked against the registry; all their problems at once, each with
    its file and line, or the plan."""
    problems: list[Problem] = []
    parsed: dict[str, Parsed] = {}
    wanted: dict[str, State] = {}
    releases = registry_releases()
    for name, text in sorted(files.items()):
        try:
            found = load(name, text)
        except FilesError as exc:
            problems += exc.problems
            continue
        state, wrong = checked(found, releases)
        problems += wrong
        if state["pool"] in wanted:
            first = parsed[state["pool"]].file
            problems.append(found.problem(("pool",), f"pool {state['pool']} is in {first} too"))
        parsed[state["pool"]], wanted[state["pool"]] = found, state
    if problems:
        raise FilesError(problems)
    pools = list(NodePool.objects.filter(name__in=wanted))
    elsewhere = NodePool.objects.exclude(name__in=wanted).values_list("name", flat=True)
    return Plan(parsed, wanted, read(pools), list(elsewhere))


@dataclass
class Applied:
    changes: list[str]
    waiting: list[int] = field(default_factory=list)  # approvals a second person must give


def _target(commit: str, **_: object) -> str:
    return f"desired:{commit}"


@audited("desired.apply", _target, (FilesError,))
def desired_apply(*, files: dict[str, str], commit: str, actor: Actor) -> Applied:
    """Make the database match `files` (file name: its text), all of it or, on a refusal,
    none of it, the refusal named at its file and line; a change a protected pool holds for a
    second person becomes an approval request, the rest is applied. Pools in no file are left
    alone."""
    if not commit.strip():
        raise FilesError([Problem("", 0, "commit", "name the files' commit (git rev-parse HEAD)")])
    found = plan(files)
    applied = Applied(found.differences())
    for pool, state in found.wanted.items():
        _apply(found.parsed[pool], state, found.current.get(pool), actor, applied.waiting)
    if applied.changes:
        audit_record(
            actor=actor,
            target=_target(commit),
            after={"commit": commit, "changes": applied.changes, "waiting": applied.waiting},
        )
    return applied


def _apply(
    parsed: Parsed, wanted: State, current: State | None, actor: Actor, waiting: list[int]
) -> None:
    name = wanted["pool"]

    def step(path: tuple[str | int, ...], call: Any, **kwargs: Any) -> None:
        try:
            call(actor=actor, **kwargs)
        except ApprovalRequired as exc:
            assert isinstance(actor, User)  # only a person's changes wait for another
            waiting.append(approval_request(refused=exc, actor=actor).pk)
        except (FleetError, TierError, ScalingError) as exc:
            raise FilesError([parsed.problem(path, str(exc))]) from None

    if current is None:
        authorize(actor, "fleet.add_nodepool", None)
        NodePool.objects.create(name=name)
        audit_record(actor=actor, target=f"pool:{name}", after={"created": True})
        current = defaults(name)
    settings: list[tuple[str, Any, dict[str, Any]]] = [
        ("queue", pool_set_queue, {"queue": wanted["queue"]}),
        ("rollback_window_s", pool_set_rollback_window, {"seconds": wanted["rollback_window_s"]}),
        ("traffic", _traffic, {"traffic": wanted["traffic"]}),
        ("discoverable", pool_set_discoverable, {"discoverable": wanted["discoverable"]}),
        ("scaling", scaling_set, wanted["scaling"]),
    ]
    for key, call, values in settings:
        if wanted[key] != current[key]:
            step((key,), call, pool_name=name, **values)
    _deployments(name, wanted, current, step)
    for model, versions in wanted["tiers"].items():
        if current["tiers"].get(model) != versions:
            step(("tiers", model), tiers_set, pool_name=name, model_name=model, versions=versions)
    # Protection last: the changes above are asked as the pool was (held if it was protected).
    if wanted["protected"] != current["protected"]:
        step(("protected",), pool_set_protected, pool_name=name, protected=wanted["protected"])


def _traffic(*, pool_name: str, traffic: dict[str, Any], actor: Actor) -> None:
    pool_set_traffic(
        pool_name=pool_name,
        traffic="" if traffic["strategy"] == "none" else traffic["strategy"],
        runtime=traffic.get("runtime", ""),
        backends=traffic.get("backends", []),
        min_serving=traffic["min_serving"],
        warmup_requests=traffic["warmup_requests"],
        drain_timeout_s=traffic["drain_timeout_s"],
        actor=actor,
    )


def _deployments(name: str, wanted: State, current: State, step: Any) -> None:
    pool = NodePool.objects.get(name=name)
    existing = {
        d.model.name: d
        for d in Deployment.objects.filter(pool=pool, node__isnull=True).select_related("model")
    }
    now = {entry["model"]: entry for entry in current["deployments"]}
    kept = {entry["model"] for entry in wanted["deployments"]}
    for model, deployment in existing.items():
        if model not in kept:
            step(("deployments",), deployment_remove, deployment_id=deployment.pk)
    for index, entry in enumerate(wanted["deployments"]):
        model = entry["model"]
        if now.get(model) == entry:
            continue
        was = existing.get(model)
        step(
            ("deployments", index),
            deployment_set,
            model_name=model,
            version=entry["version"],
            standby=entry.get("standby"),
            # A move of the standby alone keeps a rollback window's release loaded.
            baseline=was.baseline_version if was and was.version == entry["version"] else None,
            pool=pool,
        )
