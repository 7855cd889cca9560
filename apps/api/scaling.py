"""The nodes a pool needs (what an autoscaler follows), with its reasons and the nodes a
scale-in takes first; its bounds and on-call's pin."""

from typing import Any

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, Router, Schema

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, WAITS, ApiError
from apps.fleet.models import NodePool
from apps.scaling.selectors import pool_scaling
from apps.scaling.services import ScalingError, scaling_pin, scaling_set

router = Router(tags=["scaling"], auth=Token())
PATH = "/pools/{pool}/scaling"


class ScalingOut(Schema):
    pool: str
    wanted: int | None  # none: not computed yet
    nodes: int  # the pool's nodes now (not departed)
    serving: int  # of them, in traffic
    reasons: list[str]
    held: str  # why it asks for no scale-in, if it does
    least: int
    most: int | None
    pinned: int | None
    pinned_by: str
    pinned_reason: str
    remove_first: list[str]  # the nodes a scale-in to `wanted` takes, in order


class BoundsIn(Schema):
    least: int = Field(ge=0)
    most: int | None = Field(default=None, ge=1)


class PinIn(Schema):
    nodes: int | None = Field(ge=0)  # none: unpin
    reason: str = ""


def _out(pool: NodePool) -> dict[str, Any]:
    shown = pool_scaling(pool)
    fields = ("wanted", "reasons", "held", "least", "most", "pinned", "pinned_by", "pinned_reason")
    return {
        "pool": pool.name,
        "nodes": shown.nodes,
        "serving": shown.serving,
        "remove_first": list(shown.going.values_list("name", flat=True)),
        **{name: getattr(shown.scaling, name) for name in fields},
    }


@router.get(PATH, response={200: ScalingOut, **ERRORS})
def get_scaling(request: HttpRequest, pool: str) -> dict[str, Any]:
    return _out(get_object_or_404(NodePool, name=pool))


@router.put(
    PATH + "/bounds",
    response={200: ScalingOut, **WAITS, **ERRORS},
    auth=can("rollouts.add_rollout", "pool.set_scaling"),
)
def set_bounds(request: HttpRequest, pool: str, body: BoundsIn) -> dict[str, Any]:
    """The fewest and most nodes the signal may ask for; on a protected pool, they wait for a
    second person (202)."""
    try:
        scaling_set(pool_name=pool, least=body.least, most=body.most, actor=current_user(request))
    except ScalingError as exc:
        raise ApiError(409, "refused", str(exc)) from None
    return _out(NodePool.objects.get(name=pool))


@router.put(
    PATH + "/pin",
    response={200: ScalingOut, **ERRORS},
    auth=can("fleet.operate_node", "pool.pin_scaling"),
)
def pin(request: HttpRequest, pool: str, body: PinIn) -> dict[str, Any]:
    """Stop the signal at `nodes` (null: follow the readings again); `reason` is required to
    pin, and never held for a second person."""
    try:
        scaling_pin(
            pool_name=pool, nodes=body.nodes, reason=body.reason, actor=current_user(request)
        )
    except ScalingError as exc:
        raise ApiError(409, "refused", str(exc)) from None
    return _out(NodePool.objects.get(name=pool))
