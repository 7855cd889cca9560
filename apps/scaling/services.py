"""The signal, computed for every pool at once (`scaling_tick`), and what people set of it: a
pool's bounds and a pin that stops it."""

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.permissions import authorize, second_person
from apps.audit.services import (
    Actor,
    actor_name,
    audit_append,
    audit_event,
    audited,
    fields_set,
)
from apps.fleet.models import NodePool
from apps.scaling.models import Scaling
from apps.scaling.selectors import holds, node_counts, readings
from apps.scaling.signal import Bounds, Reading, Targets, nodes_wanted

AUTOSCALER = "system:autoscaler"
COMPUTED = ["wanted", "nodes", "reasons", "held", "computed_at"]


class ScalingError(Exception):
    """A pool's scaling setting refused, with why."""


def targets() -> Targets:
    return Targets(
        load=settings.SCALING_TARGET_LOAD,
        queue_ratio=settings.SCALING_QUEUE_RATIO,
        gpu=settings.SCALING_GPU_UTILIZATION,
    )


def scaling_tick() -> int:
    """Every pool's nodes wanted, from one Prometheus query and a fixed number of reads, saved
    with its reasons; each change of a pool's count is on the trail with its evidence. Returns
    how many pools' counts changed."""
    pools = dict(NodePool.objects.order_by("pk").values_list("pk", "name"))
    counts, read, held = node_counts(), readings(pools), holds()
    now, aims, events = timezone.now(), targets(), []
    with transaction.atomic():
        # Every pool's row, locked: a pin or bounds set meanwhile wait for this tick's write,
        # rather than being overwritten by a count computed without them.
        Scaling.objects.bulk_create([Scaling(pool_id=pk) for pk in pools], ignore_conflicts=True)
        rows = list(
            Scaling.objects.filter(pool_id__in=pools).order_by("pool_id").select_for_update()
        )
        for row in rows:
            name, (nodes, serving) = pools[row.pool_id], counts.get(row.pool_id, (0, 0))
            why = f"{row.pinned_reason} ({row.pinned_by})"
            signal = nodes_wanted(
                nodes=nodes,
                serving=serving,
                reading=read[row.pool_id],
                targets=aims,
                bounds=Bounds(row.least, row.most, row.pinned, why),
                holds=held.get(row.pool_id),
                last=row.wanted if row.pinned is None else None,
            )
            if signal.wanted != row.wanted:
                events.append(
                    audit_event(
                        actor=AUTOSCALER,
                        action="pool.scale",
                        target=f"pool:{name}",
                        before={"wanted": row.wanted, "nodes": nodes},
                        after={"wanted": signal.wanted, "reasons": signal.reasons},
                    )
                )
            row.wanted, row.nodes, row.reasons = signal.wanted, nodes, signal.reasons
            row.held, row.computed_at = signal.held, now
        Scaling.objects.bulk_create(
            rows, update_conflicts=True, unique_fields=["pool"], update_fields=COMPUTED
        )
        audit_append(events)
    return len(events)


def _scaling(pool_name: str, actor: Actor, permission: str) -> tuple[NodePool, Scaling]:
    """The pool's scaling row, locked, once `actor` may change it."""
    pool = NodePool.objects.filter(name=pool_name).first()
    if pool is None:
        raise ScalingError(f"no pool {pool_name!r}")
    authorize(actor, permission, pool)
    row, _ = Scaling.objects.get_or_create(pool=pool)
    return pool, Scaling.objects.select_for_update().get(pk=row.pk)


@audited("pool.set_scaling", lambda pool_name, **_: f"pool:{pool_name}", (ScalingError,))
def scaling_set(*, pool_name: str, least: int, most: int | None, actor: Actor) -> Scaling:
    """The fewest and most nodes the signal may ask for the pool. On a protected pool a
    person's change waits for a second person: it decides how many nodes serve."""
    pool, row = _scaling(pool_name, actor, "rollouts.add_rollout")
    if most is not None and most < least:
        raise ScalingError(f"pool {pool_name}: at most {most} nodes is fewer than at least {least}")
    if (least, most) != (row.least, row.most):
        params = {"pool": pool_name, "least": least, "most": most}
        second_person(actor, pool, "pool.set_scaling", params)
    fields_set(row, {"least": least, "most": most}, actor=actor, target=f"pool:{pool_name}")
    return row


@audited("pool.pin_scaling", lambda pool_name, **_: f"pool:{pool_name}", (ScalingError,))
def scaling_pin(*, pool_name: str, nodes: int | None, reason: str, actor: Actor) -> Scaling:
    """Stop the signal at `nodes` (None: let it follow the readings again). On-call's brake:
    never held for a second person, whatever the pool."""
    _, row = _scaling(pool_name, actor, "fleet.operate_node")
    if nodes is not None and not reason.strip():
        raise ScalingError("a pin needs a reason: the page and the trail show it")
    values = {
        "pinned": nodes,
        "pinned_by": "" if nodes is None else actor_name(actor),
        "pinned_reason": "" if nodes is None else reason.strip(),
    }
    if fields_set(row, values, actor=actor, target=f"pool:{pool_name}") and nodes is not None:
        # At once, not at the next tick: a brake is pulled now.
        pinned = Bounds(pinned=nodes, pinned_why=f"{row.pinned_reason} ({row.pinned_by})")
        signal = nodes_wanted(
            nodes=row.nodes, serving=0, reading=Reading(), targets=targets(), bounds=pinned
        )
        row.wanted, row.reasons, row.held = signal.wanted, signal.reasons, signal.held
        row.save(update_fields=["wanted", "reasons", "held"])
    return row
