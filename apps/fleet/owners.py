"""One owner of what a pool serves of a model at a time (`PoolOwner`): a rollout releasing it
or on-call's pin holds it; with no row the reconciler converges it and the degradation
automation may step it. An owner claims the row in its own service's transaction and lets it go
when it ends; every road that would change what the pool serves asks `owner_holding` first. A
move back (a rollback, a fallback, an abort) asks nobody."""

from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.db.models.functions import Now

from apps.fleet.models import NodePool, PoolOwner
from apps.registry.models import Model


def owners_live() -> QuerySet[PoolOwner]:
    """The owners that hold now: a pin that lapsed holds nothing."""
    return PoolOwner.objects.filter(Q(until__isnull=True) | Q(until__gt=Now()))


def owner_holding(pool: NodePool, model: Model) -> PoolOwner | None:
    """The owner of `pool`'s release of `model` now; None: the reconciler's."""
    return owners_live().filter(pool=pool, model=model).first()


def owner_claim(
    *,
    pool: NodePool,
    model: Model,
    kind: str,
    ref: str,
    why: str,
    by: str,
    until: datetime | None = None,
) -> PoolOwner | None:
    """`ref` owns `pool`'s release of `model` from now (a claim it holds already is renewed, a
    lapsed one taken over); returns the owner that holds it instead, if another does. In the
    caller's transaction: the row's unique constraint decides between two at once."""
    held = owner_holding(pool, model)
    if held is not None and held.ref != ref:
        return held
    values = {"kind": kind, "ref": ref, "why": why, "by": by, "until": until}
    try:
        with transaction.atomic():
            PoolOwner.objects.update_or_create(
                pool=pool, model=model, defaults=values | {"since": Now()}
            )
    except IntegrityError:  # another claimed it between the read and the write
        return owner_holding(pool, model)
    return None


def owner_let_go(*, pool: NodePool, model: Model, ref: str) -> None:
    """Let go of `ref`'s claim, if it still holds it (harmless to repeat)."""
    PoolOwner.objects.filter(pool=pool, model=model, ref=ref).delete()
