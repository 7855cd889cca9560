"""A pool's degradation tiers of a model, and a person's pin on one of them."""

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, WAITS, ApiError
from apps.degradation.models import Tiers
from apps.degradation.services import TierError, tier_confirm, tier_pin, tier_unpin, tiers_set
from apps.fleet.models import Deployment

router = Router(tags=["degradation"], auth=Token())
PATH = "/pools/{pool}/models/{model}/tiers"


class TiersIn(Schema):
    versions: list[int]


class PinIn(Schema):
    tier: int
    reason: str
    hours: float = 4.0


class TiersOut(Schema):
    pool: str
    model: str
    versions: list[int]
    serving: int | None  # the version the pool's deployment names now
    pinned: int | None  # the tier a pin holds, while it holds
    pinned_by: str
    pinned_reason: str
    pinned_until: datetime | None
    said: str  # the automation's last finding: why the pool is where it is
    probed: str  # its last probes of the tier above, in words
    cleared: int | None  # the tier those probes cleared, waiting for a person (protected pool)
    frozen_reason: str  # why the automation stopped itself, while it is frozen


def _out(tiers: Tiers) -> dict[str, Any]:
    serving = Deployment.objects.filter(pool=tiers.pool, model=tiers.model)
    holds = tiers.pin_holds()
    return {
        "pool": tiers.pool.name,
        "model": tiers.model.name,
        "versions": tiers.versions,
        "serving": serving.values_list("version", flat=True).first(),
        "pinned": tiers.pinned if holds else None,
        "pinned_by": tiers.pinned_by if holds else "",
        "pinned_reason": tiers.pinned_reason if holds else "",
        "pinned_until": tiers.pinned_until if holds else None,
        "said": tiers.said,
        "probed": tiers.probed,
        "cleared": tiers.cleared,
        "frozen_reason": tiers.frozen_reason if tiers.frozen_at else "",
    }


@router.get(PATH, response={200: TiersOut, **ERRORS})
def get_tiers(request: HttpRequest, pool: str, model: str) -> dict[str, Any]:
    found = Tiers.objects.filter(pool__name=pool, model__name=model).select_related("pool", "model")
    tiers = found.first()
    if tiers is None:
        raise ApiError(404, "not_found", f"{model} on {pool} has no tiers")
    return _out(tiers)


def _refused(exc: TierError) -> ApiError:
    return ApiError(409, "refused", str(exc))


@router.put(
    PATH,
    response={200: TiersOut, **WAITS, **ERRORS},
    auth=can("rollouts.add_rollout", "pool.set_tiers"),
)
def set_tiers(request: HttpRequest, pool: str, model: str, body: TiersIn) -> dict[str, Any]:
    """Published versions with the same inputs and outputs, the primary (what the pool serves)
    first; on a protected pool, they wait for a second person (202)."""
    try:
        tiers = tiers_set(
            pool_name=pool, model_name=model, versions=body.versions, actor=current_user(request)
        )
    except TierError as exc:
        raise _refused(exc) from None
    return _out(tiers)


@router.post(
    PATH + "/pin",
    response={200: TiersOut, **ERRORS},
    auth=can("rollouts.rollback_release", "pool.pin_tier"),
)
def pin_tier(request: HttpRequest, pool: str, model: str, body: PinIn) -> dict[str, Any]:
    """The pool serves tier `tier` now (0: the primary), and nothing else moves it for `hours`
    (at most a week); `reason` is required and recorded."""
    try:
        tiers = tier_pin(
            pool_name=pool,
            model_name=model,
            tier=body.tier,
            reason=body.reason,
            hours=body.hours,
            actor=current_user(request),
        )
    except TierError as exc:
        raise _refused(exc) from None
    return _out(tiers)


@router.delete(
    PATH + "/pin",
    response={200: TiersOut, **ERRORS},
    auth=can("rollouts.rollback_release", "pool.unpin_tier"),
)
def unpin_tier(request: HttpRequest, pool: str, model: str) -> dict[str, Any]:
    try:
        tiers = tier_unpin(pool_name=pool, model_name=model, actor=current_user(request))
    except TierError as exc:
        raise _refused(exc) from None
    return _out(tiers)


@router.post(
    PATH + "/confirm",
    response={200: TiersOut, **ERRORS},
    auth=can("rollouts.rollback_release", "pool.confirm_restore"),
)
def confirm_restore(request: HttpRequest, pool: str, model: str) -> dict[str, Any]:
    """On a protected pool: the switch back up that the automation's probes cleared, now."""
    try:
        tiers = tier_confirm(pool_name=pool, model_name=model, actor=current_user(request))
    except TierError as exc:
        raise _refused(exc) from None
    return _out(tiers)
