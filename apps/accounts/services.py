from django.contrib.auth.models import Group, Permission, User
from django.db import transaction

from apps.accounts.roles import ROLE_ORDER, Role, role_permissions
from apps.audit.services import audit_record, audited


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


@audited("user.role_set", lambda username, **_: f"user:{username}")
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
            action="user.role_set",
            target=f"user:{username}",
            before={"roles": before},
            after={"roles": [role.value]},
        )
    return user


def user_role(user: User) -> Role | None:
    names = set(user.groups.values_list("name", flat=True))
    for role in reversed(ROLE_ORDER):
        if role.value in names:
            return role
    return None
