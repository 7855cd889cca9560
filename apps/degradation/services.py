"""Setting a pool's degradation tiers of a model, and a person's pin on one: validated,
authorized and audited; a pin switches the pool at once and holds every other owner off."""

from datetime import timedelta
from typing import Any

from django.contrib.auth.models import User

from apps.accounts.permissions import authorize, may, moving_back, second_person
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.degradation.models import Tiers
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, NodePool, PoolOwner
from apps.fleet.owners import owner_claim, owner_holding, owner_let_go
from apps.fleet.services.deployments import deployment_set
from apps.registry.codec import from_dict
from apps.registry.ensembles import streams
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import registry_resolver
from apps.web.clock import database_now

MAX_PIN = timedelta(days=7)
PIN = "pin"  # a pin's name as the owner of what its pool serves (fleet.PoolOwner)
# On-call's own pins last a shift at most: a week-long hold on what a pool serves is a release
# manager's to decide.
MAX_ONCALL_PIN = timedelta(hours=12)


class TierError(Exception):
    pass


def _target(*, pool_name: str, model_name: str, **_: object) -> str:
    return f"pool:{pool_name}:{model_name}"


def _interface(config: dict[str, Any]) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    """A config's inputs and outputs: what a caller of the model sees."""
    return {
        kind: sorted(
            (t["name"], t.get("data_type", ""), tuple(int(d) for d in t.get("dims", [])))
            for t in config.get(kind, [])
        )
        for kind in ("input", "output")
    }


def _model_and_pool(model_name: str, pool_name: str) -> tuple[Model, NodePool]:
    model = Model.objects.filter(name=model_name).first()
    pool = NodePool.objects.filter(name=pool_name).first()
    if model is None or pool is None:
        raise TierError(f"no {'model ' + model_name if model is None else 'pool ' + pool_name}")
    return model, pool


def parse_versions(text: str) -> list[int]:
    """`1,4` or `v1, v4`: the versions of a tier list, as a person writes them."""
    try:
        return [int(v.strip().removeprefix("v")) for v in text.split(",")]
    except ValueError:
        raise TierError(f"versions: numbers separated by commas, not {text!r}") from None


@audited("pool.set_tiers", _target, (TierError,))
def tiers_set(*, pool_name: str, model_name: str, versions: list[int], actor: Actor) -> Tiers:
    """The pool's tiers of the model, the primary first: two or more published versions, each
    newer than the one above it (Triton serves a model's newest READY version, and the tier
    above stays loaded beside the one served), each answering with the same inputs and outputs
    as the primary (a caller must not notice a switch but in speed and quality). The primary
    is what the pool serves. A release manager's to set; a second person's to approve on a
    protected pool, since a pin or the automation then moves the pool onto them alone."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.add_rollout", pool)
    if len(versions) < 2 or versions != sorted(set(versions)):
        raise TierError(
            f"tiers: two or more versions, the primary first, each newer than the one above it "
            f"(Triton serves the newest loaded, and the tier above stays loaded beside the one "
            f"served: register a lighter release again as a newer version), not {versions}"
        )
    found = {v.version: v for v in model.versions.filter(version__in=versions)}
    for number in versions:
        version = found.get(number)
        if version is None:
            raise TierError(f"tiers: {model_name} has no v{number}")
        if version.status != ModelVersion.Status.PUBLISHED:
            raise TierError(f"tiers: {model_name} v{number} is {version.status}, not published")
    primary = _interface(found[versions[0]].config)
    resolve = registry_resolver()
    streaming = streams(from_dict(found[versions[0]].config), resolve)
    for number in versions[1:]:
        other = _interface(found[number].config)
        for kind in ("input", "output"):
            if other[kind] != primary[kind]:
                names = ", ".join(name for name, *_ in other[kind]) or "none"
                raise TierError(
                    f"tiers: {model_name} v{number}'s {kind}s ({names}) differ from the primary "
                    f"v{versions[0]}'s: a caller would notice the switch"
                )
        if streams(from_dict(found[number].config), resolve) != streaming:
            how = ("does not stream", "streams") if streaming else ("streams", "does not")
            raise TierError(
                f"tiers: {model_name} v{number} {how[0]} its answer and the primary "
                f"v{versions[0]} {how[1]}: a caller would notice the switch (a stream asked over "
                "HTTP is refused, a whole answer comes over a stream in one piece)"
            )
    tiers = Tiers.objects.select_for_update().filter(pool=pool, model=model).first()
    if tiers is not None and tiers.pin_holds():
        raise TierError(f"{_pinned(tiers)}: unpin it before changing its tiers")
    serving = Deployment.objects.filter(pool=pool, model=model).values_list("version", flat=True)
    served = serving.first()
    if tiers is not None and served in tiers.versions:  # on a tier below now, maybe
        served = tiers.versions[0]
    if versions[0] != served:
        what = f"serves v{served}" if served else "serves none"
        raise TierError(
            f"tiers: {model_name} on {pool_name} {what}: the primary (tier 0) is what it "
            f"serves, not v{versions[0]}; deploy or roll out another release first"
        )
    # The tiers below are releases the automation or a pin may put the pool on alone.
    params = {"pool": pool_name, "model": model_name, "versions": versions}
    second_person(actor, pool, "pool.set_tiers", params)
    before: dict[str, Any] = {"versions": list(tiers.versions) if tiers else []}
    if tiers is not None and tiers.frozen_at is not None:
        before["frozen"] = tiers.frozen_reason  # lifted by setting them: the person is on record
    tiers = tiers or Tiers(pool=pool, model=model)
    tiers.versions = versions
    tiers.frozen_at, tiers.frozen_reason = None, ""  # set again: the automation starts afresh
    tiers.save()
    _standing_by(tiers, actor)
    if before != {"versions": versions}:
        where = f"pool:{pool_name}:{model_name}"
        audit_record(actor=actor, target=where, before=before, after={"versions": versions})
    return tiers


def _standing_by(tiers: Tiers, actor: Actor) -> None:
    """The tier below the one served stands by from the moment the tiers are set, as each switch
    leaves it (Tiers.deployment): the first step down, like any other, loads nothing but the
    pipeline's own config. The deployment keeps what else it holds (a rollback window's
    release); a rollout or a pin that owns the pool's release refuses the tiers until it ends."""
    deployment = Deployment.objects.filter(pool=tiers.pool, model=tiers.model).first()
    if deployment is None or deployment.version not in tiers.versions:
        return
    standby = tiers.deployment(tiers.versions.index(deployment.version)).standby
    if standby == deployment.standby_version:
        return
    try:
        deployment_set(
            model_name=tiers.model.name,
            version=deployment.version,
            baseline=deployment.baseline_version,
            baseline_until=deployment.baseline_until,
            standby=standby,
            pool=tiers.pool,
            actor=actor,
        )
    except FleetError as exc:
        raise TierError(str(exc)) from exc


def tier_serve(tiers: Tiers, position: int, actor: Actor) -> Deployment:
    """The pool's deployment of the model set to serve tier `position` (Tiers.deployment): by a
    pin, or by the automation."""
    shape = tiers.deployment(position)
    return deployment_set(
        model_name=tiers.model.name,
        version=shape.version,
        baseline=shape.baseline,
        standby=shape.standby,
        pool=tiers.pool,
        actor=actor,
    )


def _pinned(tiers: Tiers) -> str:
    position = tiers.pinned or 0
    until = f"{tiers.pinned_until:%Y-%m-%d %H:%M} UTC" if tiers.pinned_until else ""
    return (
        f"{tiers.model.name} on {tiers.pool.name} is pinned to tier {position} "
        f"(v{tiers.versions[position]}) by {tiers.pinned_by} until {until}"
    )


@audited("pool.pin_tier", _target, (TierError,))
def tier_pin(
    *, pool_name: str, model_name: str, tier: int, reason: str, hours: float, actor: Actor
) -> Tiers:
    """On-call's pin: the pool serves tier `tier` (0, the primary, holds it at full quality)
    now, and nothing else moves it until the pin expires (at most MAX_PIN; MAX_ONCALL_PIN for
    on-call without a release manager's role there) or is lifted. A
    rollout of the model there owns the pool until it ends: it is refused meanwhile."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.rollback_release", pool)
    tiers = Tiers.objects.select_for_update().filter(pool=pool, model=model).first()
    if tiers is None:
        raise TierError(f"{model_name} on {pool_name} has no tiers: set them first")
    if not 0 <= tier < len(tiers.versions):
        raise TierError(
            f"tier {tier}: {model_name} on {pool_name} has tiers 0 to {len(tiers.versions) - 1}"
        )
    if not reason.strip():
        raise TierError("a pin needs a reason: it is what the next person reads")
    oncall = isinstance(actor, User) and not may(actor, "rollouts.add_rollout", pool.pk)
    longest = MAX_ONCALL_PIN if oncall else MAX_PIN
    if not 0 < hours <= longest / timedelta(hours=1):
        raise TierError(
            f"a pin lasts more than 0 and at most {longest / timedelta(hours=1):g} hours"
            + ("" if longest == MAX_PIN else " when on-call sets it (a release manager's, a week)")
            + f", not {hours:g}"
        )
    before = {"pinned": tiers.pinned if tiers.pin_holds() else None}
    tiers.pinned, tiers.pinned_by, tiers.pinned_reason = tier, actor_name(actor), reason.strip()
    tiers.pinned_until = database_now() + timedelta(hours=hours)
    # A rollout of the model there owns the pool until it ends; a pin owns it until it lapses.
    if held := owner_claim(
        pool=pool,
        model=model,
        kind=PoolOwner.Kind.PIN,
        ref=PIN,
        why=f"{_pinned(tiers)}: unpin it before changing the release by hand",
        by=actor_name(actor),
        until=tiers.pinned_until,
    ):
        raise TierError(held.why)
    tiers.save()
    with moving_back():  # on-call's to do alone, even on a protected pool
        try:
            tier_serve(tiers, tier, actor)
        except FleetError as exc:
            raise TierError(str(exc)) from exc
    audit_record(
        actor=actor,
        target=f"pool:{pool_name}:{model_name}",
        before=before,
        after={
            "pinned": tier,
            "version": tiers.versions[tier],
            "until": tiers.pinned_until.isoformat(),
        },
        message=reason.strip(),
    )
    return tiers


@audited("pool.confirm_restore", _target, (TierError,))
def tier_confirm(*, pool_name: str, model_name: str, actor: Actor) -> Tiers:
    """A person's go for the switch back that the automation's probes cleared on a protected
    pool (it never steps back up alone there): the pool serves that tier now. On-call's, like a
    pin: the automation was the first pair of eyes, the probes its evidence."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.rollback_release", pool)
    tiers = Tiers.objects.select_for_update().filter(pool=pool, model=model).first()
    if tiers is None or tiers.cleared is None:
        raise TierError(f"{model_name} on {pool_name} has no switch back waiting to be confirmed")
    if held := owner_holding(pool, model):
        raise TierError(held.why)
    serving = Deployment.objects.filter(pool=pool, model=model).values_list("version", flat=True)
    position, before = tiers.cleared, serving.first()
    tiers.cleared, tiers.judged_from = None, None
    tiers.save()
    with moving_back():
        try:
            tier_serve(tiers, position, actor)
        except FleetError as exc:
            raise TierError(str(exc)) from exc
    audit_record(
        actor=actor,
        target=f"pool:{pool_name}:{model_name}",
        before={"version": before},
        after={"version": tiers.versions[position], "tier": position},
        message=tiers.probed,
    )
    return tiers


@audited("pool.unpin_tier", _target, (TierError,))
def tier_unpin(*, pool_name: str, model_name: str, actor: Actor) -> Tiers:
    """Lift the pin: the pool keeps serving what it serves, and is anyone's to move again."""
    model, pool = _model_and_pool(model_name, pool_name)
    authorize(actor, "rollouts.rollback_release", pool)
    tiers = Tiers.objects.select_for_update().filter(pool=pool, model=model).first()
    if tiers is None or tiers.pinned is None:
        raise TierError(f"{model_name} on {pool_name} is not pinned")
    before = {"pinned": tiers.pinned, "by": tiers.pinned_by, "reason": tiers.pinned_reason}
    tiers.pinned, tiers.pinned_by, tiers.pinned_reason, tiers.pinned_until = None, "", "", None
    tiers.save()
    owner_let_go(pool=pool, model=model, ref=PIN)
    audit_record(actor=actor, target=f"pool:{pool_name}:{model_name}", before=before)
    return tiers
