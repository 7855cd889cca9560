"""Changes of a pool: its queue, protection, discovery, rollback window, traffic strategy and
roles."""

import re

from django.contrib.auth.models import User
from django.db import transaction

from apps.accounts.models import PoolRole
from apps.accounts.permissions import authorize, second_person
from apps.accounts.services import RoleError, user_role
from apps.audit.services import Actor, audit_record, audited, fields_set
from apps.fleet.errors import FleetError
from apps.fleet.models import NodePool
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.traffic.haproxy import HAProxyError, Runtime

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,59}")


@audited("pool.set_queue", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_queue(*, pool_name: str, queue: str, actor: Actor) -> NodePool:
    """Route the pool's node work (polls, reconciles, loads) to `queue`; empty: the default."""
    if queue and not QUEUE_NAME.fullmatch(queue):
        raise FleetError(f"queue {queue!r}: letters, digits, '_', '.' and '-', at most 60")
    return _pool_set(pool_name, {"queue": queue}, actor)


@audited("pool.set_protected", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_protected(*, pool_name: str, protected: bool, actor: Actor) -> NodePool:
    """A protected pool's deployments, promotions and rollbacks need two people."""
    return _pool_set(pool_name, {"protected": protected}, actor)


@audited("pool.set_discoverable", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_discoverable(*, pool_name: str, discoverable: bool, actor: Actor) -> NodePool:
    """Whether nodes that discovery finds labelled with this pool join it by themselves. Opening
    a protected pool needs a second person: a target that joins gets its traffic once warm."""
    pool = NodePool.objects.filter(name=pool_name).first()
    if pool is not None:
        authorize(actor, "rollouts.add_rollout", pool)  # what joins it serves its release
    if pool is not None and discoverable and not pool.discoverable:
        params = {"pool": pool_name, "discoverable": True}
        second_person(actor, pool, "pool.set_discoverable", params)
    return _pool_set(pool_name, {"discoverable": discoverable}, actor)


@audited("pool.set_rollback_window", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_rollback_window(*, pool_name: str, seconds: int, actor: Actor) -> NodePool:
    """How long, after a promotion, the release before stays loaded beside the new one (0:
    not at all): a rollback inside the window only narrows the version policy."""
    if seconds < 0:
        raise FleetError(f"pool {pool_name}: a rollback window of {seconds} s is not one")
    return _pool_set(pool_name, {"rollback_window_s": seconds}, actor)


BACKEND_NAME = re.compile(r"[A-Za-z0-9_.-]{1,60}(:grpc)?")


@audited("pool.set_traffic", lambda pool_name, **_: f"pool:{pool_name}", (FleetError,))
def pool_set_traffic(
    *,
    pool_name: str,
    traffic: str,
    actor: Actor,
    runtime: str = "",
    backends: list[str] | None = None,
    min_serving: int = 1,
    warmup_requests: int = 5,
    drain_timeout_s: int = 30,
) -> NodePool:
    """Put the pool behind a balancer (`haproxy`: its runtime API at `runtime`, the pool's nodes
    servers of `backends`), or back to shares by node count (""). The balancer is asked for its
    backends first: a setting it cannot carry out is refused, and the weights go out at once."""
    backends = backends or []
    if traffic not in NodePool.Traffic.values:
        raise FleetError(
            f"traffic {traffic!r}: one of {', '.join(map(repr, NodePool.Traffic.values))}"
        )
    if traffic:
        bad = next((name for name in backends if not BACKEND_NAME.fullmatch(name)), None)
        if not backends or bad is not None:
            raise FleetError(
                f"backends: name the HAProxy backends of the pool's nodes, not {bad!r} "
                "(`name:grpc` for a backend whose servers are the nodes' gRPC endpoints)"
            )
        try:
            for backend in backends:
                Runtime(runtime).weights(backend.partition(":")[0])
        except HAProxyError as exc:
            raise FleetError(str(exc)) from None
    if not (
        0 <= min_serving <= 1000 and 0 <= warmup_requests <= 1000 and 1 <= drain_timeout_s <= 3600
    ):
        raise FleetError("min_serving and warmup_requests: 0-1000; drain_timeout_s: 1-3600")
    settings = {
        "traffic": traffic,
        "traffic_runtime": runtime if traffic else "",
        "traffic_backends": ",".join(backends) if traffic else "",
        "min_serving": min_serving,
        "warmup_requests": warmup_requests,
        "drain_timeout_s": drain_timeout_s,
    }
    pool = _pool_set(pool_name, settings, actor)
    # Once committed: the balancer is never asked while the pool's row is held.
    transaction.on_commit(lambda: traffic_sync(pool.pk), robust=True)
    return pool


def _pool_set(pool_name: str, values: dict[str, object], actor: Actor) -> NodePool:
    """Settings of a pool, audited as its service's action when any of them changes."""
    pool = NodePool.objects.select_for_update().filter(name=pool_name).first()
    if pool is None:
        raise FleetError(f"no pool {pool_name!r}")
    fields_set(pool, values, actor=actor, target=f"pool:{pool_name}")
    return pool


@audited("user.set_pool_role", lambda username, **_: f"user:{username}", (RoleError,))
def pool_role_set(*, username: str, pool_name: str, role: str, actor: Actor) -> None:
    """Give `username` `role` (operator or release_manager) on one pool, or none ("")."""
    user = User.objects.filter(username=username).first()
    pool = NodePool.objects.filter(name=pool_name).first()
    if user is None:
        raise RoleError(f"no user named {username!r}")
    if pool is None:
        raise RoleError(f"no pool named {pool_name!r}")
    if role and role not in PoolRole.Role.values:
        raise RoleError(f"a pool role is one of {', '.join(PoolRole.Role.values)}, not {role!r}")
    if user_role(user) is None:
        raise RoleError(f"{username} has no role: give them one (viewer at least) first")
    held = PoolRole.objects.filter(user=user, pool=pool).values_list("role", flat=True).first()
    if (held or "") == role:
        return
    if role:
        PoolRole.objects.update_or_create(user=user, pool=pool, defaults={"role": role})
    else:
        PoolRole.objects.filter(user=user, pool=pool).delete()
    audit_record(
        actor=actor,
        target=f"user:{username}",
        before={"pool": pool_name, "role": held or ""},
        after={"pool": pool_name, "role": role},
    )
