import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import Group, Permission, User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.models import ApiToken
from apps.accounts.roles import ROLE_ORDER, Role, role_permissions
from apps.audit.services import Actor, audit_record, audited


@transaction.atomic
def roles_sync() -> list[Group]:
    """Create or update the role groups; re-running converges to the same permissions."""
    groups = []
    for role in ROLE_ORDER:
        group, _ = Group.objects.get_or_create(name=role.value)
        wanted = []
        for dotted in role_permissions(role):
            app_label, codename = dotted.split(".")
            wanted.append(
                Permission.objects.get(content_type__app_label=app_label, codename=codename)
            )
        group.permissions.set(wanted)
        groups.append(group)
    return groups


@audited("user.set_role", lambda username, **_: f"user:{username}")
def user_ensure(*, username: str, password: str, role: Role, actor: str = "system") -> User:
    """Create the user if missing and give it exactly one role; audited when something changed."""
    user, created = User.objects.get_or_create(username=username)
    if created:
        user.set_password(password)
        user.is_staff = role is Role.ADMIN
        user.is_superuser = role is Role.ADMIN
        user.save()
    before = sorted(user.groups.values_list("name", flat=True))
    if created or before != [role.value]:
        user.groups.set([Group.objects.get(name=role.value)])
        audit_record(
            actor=actor,
            target=f"user:{username}",
            before={"roles": before},
            after={"roles": [role.value]},
        )
    return user


class RoleError(Exception):
    pass


def user_role(user: User) -> Role | None:
    names = set(user.groups.values_list("name", flat=True))
    for role in reversed(ROLE_ORDER):
        if role.value in names:
            return role
    return None


class TokenError(Exception):
    pass


TOKEN_PREFIX = "tcp_"  # noqa: S105 - not a secret: marks tokens for logs and secret scanners


def token_digest(token: str) -> str:
    """Tokens are long and random, so a plain SHA-256 is enough to keep them unreadable; a slow
    password hash would cost every API call."""
    return hashlib.sha256(token.encode()).hexdigest()


@audited("token.create", lambda user, **_: f"user:{user.username}", (TokenError,))
def token_create(
    *,
    user: User,
    name: str,
    actor: Actor,
    days: int | None = None,
    scope: str = ApiToken.Scope.WRITE,
) -> tuple[ApiToken, str]:
    """A new token for `user`, expiring after `days` (API_TOKEN_MAX_DAYS by default and at
    most): the record, and the token itself, which is never stored."""
    name = name.strip()
    if not name or len(name) > 80:
        raise TokenError("name the token (1 to 80 characters): what will use it?")
    limit = settings.API_TOKEN_MAX_DAYS
    days = limit if days is None else days
    if not 1 <= days <= limit:
        raise TokenError(f"a token lives 1 to {limit} days, not {days}")
    if scope not in ApiToken.Scope.values:
        raise TokenError(f"scope is one of {', '.join(ApiToken.Scope.values)}, not {scope!r}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    record = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=token[: len(TOKEN_PREFIX) + 6],
        digest=token_digest(token),
        expires_at=timezone.now() + timedelta(days=days),
        scope=scope,
    )
    audit_record(
        actor=actor,
        target=f"user:{user.username}",
        after={"token": str(record), "scope": scope, "expires_at": record.expires_at.isoformat()},
    )
    return record, token


def _token_target(*, token_id: int, **_: object) -> str:
    found = ApiToken.objects.filter(pk=token_id).values_list("user__username", flat=True).first()
    return f"user:{found}" if found else f"token:{token_id}"


@audited("token.revoke", _token_target, (TokenError,))
def token_revoke(*, token_id: int, actor: Actor) -> ApiToken:
    """Revoked at once: the next call with it is refused. A user revokes only their own tokens
    unless they may manage users."""
    token = ApiToken.objects.select_for_update().select_related("user").filter(pk=token_id).first()
    own = isinstance(actor, User) and token is not None and token.user_id == actor.pk
    allowed = not isinstance(actor, User) or own or actor.has_perm("auth.change_user")
    if token is None or not allowed:
        raise TokenError(f"there is no token {token_id} of yours")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(
            actor=actor,
            target=f"user:{token.user.username}",
            after={"token": str(token)},
        )
    return token


def token_authenticate(token: str) -> ApiToken | None:
    """The live token a caller presented, its use noted (once a minute at most: a busy pipeline
    should not write on every call); None when it is unknown, revoked or expired."""
    now = timezone.now()
    found = (
        ApiToken.objects.select_related("user")
        .filter(
            digest=token_digest(token),
            revoked_at__isnull=True,
            expires_at__gt=now,
            user__is_active=True,
        )
        .first()
    )
    if found is not None:
        stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - timedelta(minutes=1))
        ApiToken.objects.filter(stale, pk=found.pk).update(last_used_at=now)
    return found
