"""Who may do what, where. A user's global role (a Django group) grants its permissions on every
pool; a PoolRole grants a higher role's on one pool. Views and the API check that the user may
act somewhere (`require`, apps.api.auth); services check the pool they act on (`authorize`)."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from typing import Any

from django.contrib.auth.models import AnonymousUser, User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import render

from apps.accounts.models import PoolRole
from apps.accounts.roles import roles_granting
from apps.audit.models import AuditEvent
from apps.audit.services import Actor, audit_record

View = Callable[..., HttpResponseBase]
# What the viewer role grants first: a user without it has no role, and sees nothing.
ANY_ROLE = "fleet.view_node"
# What a role held on one pool can grant there. The registry (models, versions, imports) and the
# pools themselves are fleet-wide: only a global role grants their permissions.
POOL_SCOPED = frozenset(
    {
        "fleet.operate_node",
        "rollouts.add_rollout",
        "rollouts.change_rollout",
        "rollouts.rollback_release",
    }
)


def current_user(request: HttpRequest) -> User:
    """The signed-in user; LoginRequiredMiddleware guarantees one on every view."""
    assert isinstance(request.user, User)
    return request.user


def _pool_roles(permission: str) -> list[str]:
    return [role.value for role in roles_granting(permission) if role in PoolRole.Role.values]


def _held(user: User) -> dict[int, str]:
    """The user's pool roles, read once per user object (a page asks for each row)."""
    held = getattr(user, "_pool_roles", None)
    if held is None:
        held = dict(PoolRole.objects.filter(user=user).values_list("pool_id", "role"))
        user._pool_roles = held  # type: ignore[attr-defined]
    return held


def may(user: User | AnonymousUser, permission: str, pool_id: int | None) -> bool:
    """`permission` on that pool: from the global role, or a role held on the pool."""
    if user.has_perm(permission):
        return True
    if pool_id is None or not isinstance(user, User) or permission not in POOL_SCOPED:
        return False
    return _held(user).get(pool_id) in _pool_roles(permission)


def may_somewhere(user: User | AnonymousUser, permission: str) -> bool:
    """`permission` on at least one pool: enough to be shown the form; the service decides."""
    if user.has_perm(permission):
        return True
    if not isinstance(user, User) or permission not in POOL_SCOPED:
        return False
    return any(role in _pool_roles(permission) for role in _held(user).values())


def authorize(actor: Actor, permission: str, pool: Any) -> None:
    """Raise PermissionDenied unless `actor` holds `permission` on `pool` (a NodePool; None: a
    permission that no pool scopes). System actors (names, not users: the controller, the
    reconciler, commands) act everywhere."""
    if isinstance(actor, User) and not may(actor, permission, pool.pk if pool else None):
        where = f" on pool {pool.name}" if pool else ""
        raise PermissionDenied(
            f"{actor.username} may not do that{where}: it needs {permission}"
            + (" there" if pool else "")
        )


def authorize_audited(actor: Actor, permission: str, pool: Any, action: str) -> None:
    """`authorize`, a refusal recorded as `action` denied: for a view that checks the pool a
    request names before it does anything on the person's behalf (asks Prometheus, validates
    a form against what the pool runs)."""
    try:
        authorize(actor, permission, pool)
    except PermissionDenied as exc:
        target = f"pool:{pool.name}" if pool else ""
        audit_record(actor=actor, action=action, target=target, result="denied", message=str(exc))
        raise


# The approval whose action is being carried out (apps.approvals.services), if any.
APPROVING: ContextVar[int | None] = ContextVar("approving", default=None)
# A move back under way (an abort, a rollback, a fallback): whatever it changes on the way (the
# pool's deployment, canary nodes' own ones) is never held for a second person.
MOVING_BACK: ContextVar[bool] = ContextVar("moving_back", default=False)


@contextmanager
def moving_back() -> Iterator[None]:
    """On-call must always be able to stop a bad release, alone, at 3 a.m.: a move back is
    never held for approval on a protected pool; its audit event says who did it and why."""
    token = MOVING_BACK.set(True)
    try:
        yield
    finally:
        MOVING_BACK.reset(token)


class ApprovalRequired(PermissionDenied):
    """A person's change to a protected pool: it waits for a second person to approve it.
    Carries what to do once approved (an action of apps.approvals.services and its arguments)."""

    def __init__(self, action: str, params: dict[str, Any], pool: Any) -> None:
        self.action, self.params, self.pool = action, params, pool
        super().__init__(
            f"pool {pool.name} is protected: {action} waits for a second person to approve it"
        )


def second_person(actor: Actor, pool: Any, action: str, params: dict[str, Any]) -> None:
    """On a protected pool, a person's `action` needs an approval first (system actors, such as
    the rollout controller promoting a canary that passed, act alone); a move back never waits."""
    if (
        pool.protected
        and isinstance(actor, User)
        and APPROVING.get() is None
        and not MOVING_BACK.get()
    ):
        raise ApprovalRequired(action, params, pool)


def require(permission: str, action: str) -> Callable[[View], View]:
    """Refuse (403, audited) a user without `permission` on any pool; the role check is always
    server-side, and the service checks the pool it acts on."""

    def decorator(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if may_somewhere(request.user, permission):
                return view(request, *args, **kwargs)
            audit_record(
                actor=current_user(request),
                action=action,
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"missing permission {permission}",
            )
            context = {"permission": permission, "action": action}
            return render(request, "403.html", context, status=403)

        wrapped.required = (permission, action)  # type: ignore[attr-defined]  # for tests/unit/test_audit.py
        return wrapped

    return decorator


class RoleRequiredMiddleware:
    """A signed-in user without a role (not even viewer) is refused every page: signing in
    proves who someone is, not that they may read the fleet, its audit trail or its models."""

    ALLOWED = ("/accounts/logout/", "/accounts/login/")

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = request.user
        if (
            user.is_authenticated
            and not user.has_perm(ANY_ROLE)
            and not request.path.startswith(self.ALLOWED)
        ):
            context = {"permission": ANY_ROLE, "action": "reading the control plane"}
            return render(request, "403.html", context, status=403)
        return self.get_response(request)
