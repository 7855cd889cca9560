"""A rollout's start: checked, what each step will do to which nodes (the dry run that the form
previews), then started as the pool's one active rollout of its models."""

from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, transaction

from apps.accounts.permissions import authorize, second_person
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.desired import Want
from apps.fleet.memory import shortfalls
from apps.fleet.models import Deployment, NodePool
from apps.observability.llm import Fit, release_fits
from apps.quality.models import EvaluationSet
from apps.quality.selectors import latest_set
from apps.registry.ensembles import UnresolvedStep
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import stored_steps
from apps.rollouts.members import Member, changed_steps
from apps.rollouts.models import AnalysisTemplate, Rollout
from apps.rollouts.plans import Analysis, PlanError, PreviewStep, parse_plan, preview
from apps.rollouts.transitions import notify, pool_claim


class RolloutError(Exception):
    """Why a rollout action was refused, in words fit for the page."""


@dataclass(frozen=True)
class Proposal:
    model: Model
    pool: NodePool
    baseline: int
    canary: int
    plan: list[dict[str, int]]
    analysis: Analysis
    preview: list[PreviewStep]
    template: AnalysisTemplate | None = None
    lockstep: list[dict[str, Any]] = field(default_factory=list)  # as Rollout.lockstep
    memory: list[str] = field(default_factory=list)  # nodes where it would not fit, and why
    budgets: list[Fit] = field(default_factory=list)  # each LLM step against its budget
    strategy: str = Rollout.Strategy.CANARY
    quality_sets: dict[str, int] = field(default_factory=dict)  # as Rollout.quality_sets

    @property
    def unfit(self) -> list[Fit]:
        """The LLM steps not shown to fit their budget: over it, or not measured."""
        return [fit for fit in self.budgets if not fit.fits]


def _template(name: str, version: int | None, model: Model, pool: NodePool) -> AnalysisTemplate:
    """Template `name` at `version` (its latest: None), if it may judge `model` on `pool`."""
    versions = AnalysisTemplate.objects.filter(name=name).select_related("model", "pool")
    found = (versions.filter(version=version) if version is not None else versions).first()
    if found is None:
        at = f" v{version}" if version is not None else ""
        raise RolloutError(f"no analysis template {name!r}{at}")
    for scope, given in ((found.model, model), (found.pool, pool)):
        if scope is not None and scope != given:
            raise RolloutError(f"analysis template {found} is for {scope}, not {given}")
    return found


def rollout_propose(
    *,
    model_name: str,
    pool_name: str,
    canary_version: int,
    plan: str | list[dict[str, Any]],
    analysis: dict[str, Any] | None = None,
    accept_shares: bool = False,
    template: str = "",
    lockstep: list[tuple[str, int]] | None = None,
    strategy: str = Rollout.Strategy.CANARY,
    template_version: int | None = None,
    quality_sets: dict[str, int] | None = None,
) -> Proposal:
    """Check a rollout before it starts and say what each step will do to which nodes (the
    dry run). A share in percent is whole nodes here, each taking its part of the requests: a
    step that would get more than twice its share is refused unless `accept_shares`.
    `lockstep`: other models (name, canary version) released with it as one. A blue-green
    release has one step, every node at once, and no plan of its own. Its gates' evaluation
    sets are the newest versions now, or exactly `quality_sets` (and the template exactly
    `template_version`): what an approval showed. Raises RolloutError or PlanError."""
    if strategy not in Rollout.Strategy.values:
        raise RolloutError(f"no strategy {strategy!r}; one of {', '.join(Rollout.Strategy)}")
    blue_green = strategy == Rollout.Strategy.BLUE_GREEN
    if blue_green:
        plan = "100%"
    if not Model.objects.filter(name=model_name).exists():
        raise RolloutError(f"no model {model_name!r} in the registry")
    pool = NodePool.objects.filter(name=pool_name).first()
    if pool is None:
        raise RolloutError(f"no pool {pool_name!r}")
    pool_nodes = list(pool.nodes.serving())
    nodes = [node.name for node in pool_nodes]
    if not nodes:
        raise RolloutError(f"pool {pool_name} has no nodes")
    model, baseline = _releasable(model_name, canary_version, pool)
    releases = [Member(model, baseline, canary_version)]
    for name, version in lockstep or []:
        if any(m.model.name == name for m in releases):
            raise RolloutError(f"{name} is released twice in one rollout")
        releases.append(Member(*_releasable(name, version, pool), version))
    steps = parse_plan(plan)
    counts = [s.canary_count(len(nodes)) for s in steps]
    shrinking = next((i for i in range(1, len(counts)) if counts[i] < counts[i - 1]), None)
    if shrinking is not None:
        raise PlanError(
            f"step {shrinking + 1}: {counts[shrinking]} canary nodes after {counts[shrinking - 1]}"
            "; a step may only widen the canary"
        )
    rows = preview(steps, nodes, weighted=bool(pool.traffic))
    far = next((row for row in rows if row.overshoots), None)
    if far is not None and not accept_shares:
        raise PlanError(
            f"step {far.index + 1}: {far.step.percent}% of pool {pool_name} is "
            f"{far.real_share}, more than twice the share asked; accept the real shares to go "
            "on, or give the step in nodes"
        )
    chosen = _template(template, template_version, model, pool) if template else None
    # What is given here overrides the template, which overrides the defaults.
    judged = Analysis.from_dict((chosen.analysis if chosen else {}) | (analysis or {}))
    if pool.protected:
        _as_strict_as_the_pool(judged, pool)
    if judged.perf_concurrency:
        _perf_gate_checks(pool, model, blue_green)
    if blue_green:
        gated = _blue_green_checks(releases, judged)
        # Each node with the new release's steps standing by beside what it serves.
        label = f"{model_name} v{canary_version}, on standby"
        change = {model_name: Want(baseline, None, label, standby=canary_version)}
    else:
        if judged.quality_set and latest_set(model_id=model.pk, name=judged.quality_set) is None:
            raise RolloutError(
                f"{model_name} has no evaluation set {judged.quality_set!r} for the quality "
                "gate; import one first"
            )
        gated = [model] if judged.quality_set else []
        # Each node as a canary node would be, the baseline beside the canary: the widest step.
        change = {
            m.model.name: Want(m.canary, m.beside, f"{m.model.name} v{m.canary}, a canary")
            for m in releases
        }
    short = shortfalls(pool, pool_nodes, change)
    budgets = release_fits([(m.model, m.canary) for m in releases], pool.name)
    if judged.strict_budget and (unfit := [f for f in budgets if not f.fits]):
        raise RolloutError("strict LLM budget: " + "; ".join(str(f) for f in unfit))
    return Proposal(
        model=model,
        pool=pool,
        baseline=baseline,
        canary=canary_version,
        plan=[s.as_dict() for s in steps],
        analysis=judged,
        preview=rows,
        template=chosen,
        lockstep=[
            {"model": m.model.name, "baseline": m.baseline, "canary": m.canary}
            for m in releases[1:]
        ],
        memory=short,
        budgets=budgets,
        strategy=strategy,
        quality_sets=_quality_sets(judged.quality_set, gated, quality_sets),
    )


def _quality_sets(name: str, gated: list[Model], given: dict[str, int] | None) -> dict[str, int]:
    """The evaluation set each `gated` model's gate runs, pinned: the newest version of `name`
    now, or exactly the ones `given` (what an approval showed, however many came since)."""
    if given is None:
        newest = (latest_set(model_id=model.pk, name=name) for model in gated)
        return {model.name: found.pk for model, found in zip(gated, newest, strict=True) if found}
    pinned = EvaluationSet.objects.filter(
        model__in=gated, name=name, pk__in=given.values()
    ).values_list("model__name", "pk")
    if dict(pinned) != given:
        raise RolloutError(
            f"evaluation sets {given} are not {name!r} of {', '.join(m.name for m in gated)}"
        )
    return given


def _blue_green_checks(releases: list[Member], analysis: Analysis) -> list[Model]:
    """A blue-green release switches a pipeline's pins: its changed steps load beside the ones
    serving and are evaluated, each by its own evaluation set of the analysis's name, on every
    node, before the switch. Returns those steps' models."""
    lead = releases[0]
    name = lead.model.name
    if len(releases) > 1:
        raise RolloutError("a blue-green release switches one pipeline; release it alone")
    if lead.model.kind != Model.Kind.ENSEMBLE:
        raise RolloutError(
            f"{name} is not a pipeline: blue-green switches a pipeline to the step versions it "
            "pins; release the pipeline version that pins the new one"
        )
    changed = changed_steps(lead)
    if not changed:
        raise RolloutError(
            f"{name} v{lead.canary} pins the same step versions as v{lead.baseline}: nothing "
            "to load beside them"
        )
    if not analysis.quality_set:
        raise RolloutError(
            "a blue-green release is evaluated before it switches: name an evaluation set "
            "(quality_set)"
        )
    gated = []
    for step in changed:
        found = Model.objects.filter(name=step.model).first()
        if found is None or latest_set(model_id=found.pk, name=analysis.quality_set) is None:
            raise RolloutError(
                f"step {step.model} (v{step.baseline} -> v{step.canary}) has no evaluation set "
                f"{analysis.quality_set!r} to validate it before the switch; import one first"
            )
        gated.append(found)
    return gated


def _perf_gate_checks(pool: NodePool, model: Model, blue_green: bool) -> None:
    """The performance gate measures a canary no user reaches yet: only a pool whose balancer
    holds its traffic back can give it that, and only a canary's first step."""
    if blue_green:
        raise RolloutError(
            "the performance gate measures a canary before its first step; a blue-green release "
            "has none (perf_concurrency)"
        )
    if not pool.traffic:
        raise RolloutError(
            f"the performance gate needs the canary drained while it is measured, and pool "
            f"{pool.name} has no balancer to hold its traffic back (perf_concurrency); give the "
            "pool a traffic strategy, or release without the gate"
        )
    if not model.sample_inputs:
        raise RolloutError(
            f"the performance gate sends {model.name}'s own inputs, and it has none; import an "
            "evaluation set for it first"
        )


def _as_strict_as_the_pool(analysis: Analysis, pool: NodePool) -> None:
    """On a protected pool, a release is judged and acted on: a dry run (which goes on whatever
    the verdict) is refused, and so is an analysis looser than the pool's own template (its
    newest), since the controller promotes alone on what the analysis passes."""
    if analysis.dry_run:
        raise RolloutError(
            f"pool {pool.name} is protected: a dry run goes on whatever the verdict, so it may "
            "not release there"
        )
    template = AnalysisTemplate.objects.filter(pool=pool).order_by("-created_at", "-id").first()
    looser = analysis.looser_than(Analysis.from_dict(template.analysis)) if template else []
    if looser:
        raise RolloutError(
            f"pool {pool.name} is protected: the analysis is looser than its template "
            f"{template}: {'; '.join(looser)}"
        )


def _releasable(model_name: str, canary_version: int, pool: NodePool) -> tuple[Model, int]:
    """The model and the version the pool runs of it (the baseline), if `canary_version` may
    roll out over it."""
    model = Model.objects.filter(name=model_name).first()
    if model is None:
        raise RolloutError(f"no model {model_name!r} in the registry")
    deployed = Deployment.objects.filter(model=model, pool=pool).first()
    if deployed is None:
        raise RolloutError(f"pool {pool.name} does not run {model_name}: deploy a baseline first")
    canary = model.versions.filter(version=canary_version).first()
    if canary is None:
        raise RolloutError(f"{model_name} v{canary_version} is not in the registry")
    if canary.status != ModelVersion.Status.PUBLISHED:
        raise RolloutError(f"{model_name} v{canary_version} is {canary.status}, not published")
    if canary_version == deployed.version:
        raise RolloutError(f"pool {pool.name} already runs {model_name} v{canary_version}")
    try:
        stored_steps(canary.config)
    except UnresolvedStep as exc:
        raise RolloutError(f"{model_name} v{canary_version}: {exc}") from None
    return model, deployed.version


def active_rollout(models: list[str], pool: NodePool) -> Rollout | None:
    """The active rollout on `pool` that releases one of `models`, on its own or in lockstep."""
    running = Rollout.objects.filter(pool=pool, state__in=Rollout.ACTIVE).select_related("model")
    return next((r for r in running if set(r.model_names) & set(models)), None)


def pool_target(*, model_name: str, pool_name: str, **_: object) -> str:
    return f"pool:{pool_name}:{model_name}"


@audited("rollout.start", pool_target, (RolloutError, PlanError))
def rollout_start(
    *,
    model_name: str,
    pool_name: str,
    canary_version: int,
    plan: str | list[dict[str, Any]],
    analysis: dict[str, Any] | None,
    actor: Actor,
    accept_shares: bool = False,
    template: str = "",
    lockstep: list[tuple[str, int]] | None = None,
    strategy: str = Rollout.Strategy.CANARY,
    template_version: int | None = None,
    quality_sets: dict[str, int] | None = None,
) -> Rollout:
    """A rollout of `canary_version` over what the pool serves, as `rollout_propose` checks it;
    its gates run the evaluation sets it pins now (or exactly `quality_sets`, with the
    template's `template_version`: what an approval showed)."""
    proposal = rollout_propose(
        model_name=model_name,
        pool_name=pool_name,
        canary_version=canary_version,
        plan=plan,
        analysis=analysis,
        accept_shares=accept_shares,
        template=template,
        lockstep=lockstep,
        strategy=strategy,
        template_version=template_version,
        quality_sets=quality_sets,
    )
    authorize(actor, "rollouts.add_rollout", proposal.pool)
    # The approver sees exactly what will run: the plan and the analysis as resolved now.
    second_person(actor, proposal.pool, "rollout.start", _start_params(proposal, template))
    names = [model_name, *(m["model"] for m in proposal.lockstep)]
    try:
        with transaction.atomic():  # the database has the last word on "one active rollout"
            # Under the pool's lock, no other start can slip a rollout of a lockstep model in.
            NodePool.objects.select_for_update().filter(pk=proposal.pool.pk).first()
            running = active_rollout(names, proposal.pool)
            if running is not None:
                raise RolloutError(
                    f"rollout #{running.pk} of {running.moves} on {pool_name} is {running.state}"
                )
            rollout = Rollout.objects.create(
                model=proposal.model,
                pool=proposal.pool,
                baseline_version=proposal.baseline,
                canary_version=proposal.canary,
                lockstep=proposal.lockstep,
                strategy=proposal.strategy,
                plan=proposal.plan,
                analysis=proposal.analysis.as_dict(),
                template=proposal.template,
                quality_sets=proposal.quality_sets,
                started_by=actor_name(actor),
            )
            notify(rollout, "started")  # written with the rollout, or not at all
            if held := pool_claim(rollout, actor_name(actor)):
                raise RolloutError(held.why)  # another owner: on-call's pin on a tier
    except IntegrityError:
        raise RolloutError(f"another rollout of {model_name} on {pool_name} is active") from None
    audit_record(
        actor=actor,
        target=f"rollout:{rollout.pk}:{model_name}",
        after={
            "baseline": proposal.baseline,
            "canary": canary_version,
            "plan": proposal.plan,
            "strategy": proposal.strategy,
            "pool": pool_name,
            "template": str(proposal.template or ""),
            "lockstep": proposal.lockstep,
            "quality_sets": proposal.quality_sets,
        },
    )
    return rollout


def _start_params(proposal: Proposal, template: str) -> dict[str, Any]:
    return {
        "model": proposal.model.name,
        "pool": proposal.pool.name,
        "baseline": proposal.baseline,
        "canary": proposal.canary,
        "plan": proposal.plan,
        "analysis": proposal.analysis.as_dict(),
        "template": template,
        "template_version": proposal.template.version if proposal.template else None,
        "quality_sets": proposal.quality_sets,
        "lockstep": proposal.lockstep,
        "accept_shares": any(row.overshoots for row in proposal.preview),
        "strategy": proposal.strategy,
    }
