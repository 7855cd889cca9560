"""Named users per role, and their API tokens."""

from django.contrib.auth.models import User

from apps.accounts.roles import Role
from apps.accounts.services import token_create

PASSWORD = "correct-horse-battery"


def make_user(role: Role) -> User:
    from apps.accounts.services import roles_sync, user_ensure

    roles_sync()
    return user_ensure(username=f"{role.value}-user", password=PASSWORD, role=role)


def bearer(user: User) -> dict[str, str]:
    _, value = token_create(user=user, name="ci", actor="system:test")
    return {"Authorization": f"Bearer {value}"}
