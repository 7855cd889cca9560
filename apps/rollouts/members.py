"""What a rollout releases, and where: its model and those released in lockstep with it (its
members), the steps a pipeline's release changes, the pool's nodes and the step's canary among
them, and what they are read back serving."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from apps.fleet import selectors
from apps.fleet.models import Deployment, Node
from apps.registry.ensembles import UnresolvedStep
from apps.registry.models import Model
from apps.registry.selectors import stored_steps
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Step, canary_nodes, parse_plan


def pool_nodes(rollout: Rollout) -> list[Node]:
    """The pool's serving nodes: one joining, quarantined or departed is no rollout's (it gets
    the pool's release when it joins)."""
    return list(rollout.pool.nodes.serving().order_by("name"))


@dataclass(frozen=True)
class Member:
    """One model a rollout releases: its own, or one released in lockstep with it."""

    model: Model
    baseline: int
    canary: int

    @property
    def beside(self) -> int | None:
        """The baseline kept READY beside the canary, so that rolling back only narrows the
        version policy; none when the canary's number is lower, since an unversioned request
        goes to the highest READY version."""
        return self.baseline if self.canary > self.baseline else None

    @property
    def versions(self) -> set[int]:
        """What a canary node serves."""
        return {self.canary} | ({self.beside} if self.beside else set())


def members(rollout: Rollout) -> list[Member]:
    """The models a rollout releases, in dependency order: plain models before the pipelines
    that may pin them. They go to the same nodes, are judged together and promote or roll back
    as one."""
    lead = Member(rollout.model, rollout.baseline_version, rollout.canary_version)
    if not rollout.lockstep:
        return [lead]
    models = Model.objects.in_bulk([m["model"] for m in rollout.lockstep], field_name="name")
    found = [
        lead,
        *(Member(models[m["model"]], m["baseline"], m["canary"]) for m in rollout.lockstep),
    ]
    return sorted(found, key=lambda m: m.model.kind == Model.Kind.ENSEMBLE)


@dataclass(frozen=True)
class Scope:
    """What a tick of a rollout acts on, read once: the pool's serving nodes, the current step
    and its canary nodes among them, and the models it releases."""

    nodes: list[Node]
    step: Step
    canary: list[Node]
    released: list[Member]  # in dependency order
    lead: Member  # the rollout's own model
    last: bool  # the plan's last step

    @property
    def compare(self) -> bool:
        """Whether a node still serves the baseline, to compare the canary with."""
        return len(self.canary) < len(self.nodes)


def scope(rollout: Rollout) -> Scope:
    steps = parse_plan(rollout.plan)
    step, nodes, released = steps[rollout.step], pool_nodes(rollout), members(rollout)
    names = set(canary_nodes(step, [n.name for n in nodes]))
    return Scope(
        nodes=nodes,
        step=step,
        canary=[n for n in nodes if n.name in names],
        released=released,
        lead=next(m for m in released if m.model == rollout.model),
        last=rollout.step + 1 == len(steps),
    )


@dataclass(frozen=True)
class ChangedStep:
    """A pipeline step that a release pins at another version than its baseline does."""

    model: str
    canary: int  # the version the canary release pins
    baseline: int  # the version the baseline release pins
    budget_ms: int | None


def changed_steps(member: Member) -> list[ChangedStep]:
    """The steps an ensemble release pins at another version than its baseline does."""
    return judged_by(member).steps


@dataclass(frozen=True)
class Judged:
    """What a member's analysis reads besides the member's own series."""

    steps: list[ChangedStep]  # the steps its release changes
    speaker: str  # the model whose series tell an LLM's first token and tokens


def judged_by(member: Member) -> Judged:
    """The steps an ensemble release changes, and its speaker: the step that streams
    (decoupled) among those its canary release pins, or the member itself."""
    configs = dict(
        member.model.versions.filter(version__in=[member.baseline, member.canary]).values_list(
            "version", "config"
        )
    )

    def pins(version: int) -> dict[tuple[str, int], Any]:
        if version not in configs:
            return {}
        try:
            return stored_steps(configs[version])
        except UnresolvedStep:  # no longer loadable: nothing to compare
            return {}

    canary, baseline = pins(member.canary), pins(member.baseline)
    was = {name: number for name, number in baseline}
    names = {name for name, _ in canary}
    budgets = dict(Model.objects.filter(name__in=names).values_list("name", "latency_budget_ms"))
    steps = [
        ChangedStep(name, version, before, budgets.get(name))
        for name, version in sorted(canary)
        if (before := was.get(name)) is not None and before != version
    ]
    streaming = [name for (name, _), c in canary.items() if c.model_transaction_policy.decoupled]
    return Judged(steps, streaming[-1] if streaming else member.model.name)


def serves(deployment: Deployment) -> set[int]:
    """The versions a deployment keeps READY: its own, and the one kept beside it."""
    return {v for v in (deployment.version, deployment.baseline_version) if v}


def pool_deployments(rollout: Rollout, released: list[Member]) -> dict[str, Deployment]:
    """The pool's own deployments of the models the rollout releases, by model name."""
    found = Deployment.objects.filter(model__in=[m.model for m in released], pool=rollout.pool)
    return {d.model.name: d for d in found.select_related("model")}


def all_serve(
    rollout: Rollout, versions: dict[str, set[int]], timed: list[str] | None = None
) -> datetime | None:
    """None while a node of the pool is not read back serving exactly each model's `versions`;
    then since when all of them (or all `timed` nodes) do."""
    nodes = pool_nodes(rollout)
    found = selectors.observed_many(nodes, list(versions))
    if not nodes or any(
        found[(n.pk, name)][0] != wanted for n in nodes for name, wanted in versions.items()
    ):
        return None
    since = [
        found[(n.pk, name)][1] for n in nodes if not timed or n.name in timed for name in versions
    ]
    return max((at for at in since if at is not None), default=timezone.now())
