import itertools

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command

from apps.accounts.roles import ROLE_ORDER, Role, role_permissions
from apps.accounts.services import user_role
from apps.audit.models import AuditEvent


@pytest.mark.django_db
def test_setup_roles_creates_four_nested_roles_and_demo_users() -> None:
    call_command("setup_roles", "--demo-users")
    call_command("setup_roles", "--demo-users")  # idempotent
    assert sorted(Group.objects.values_list("name", flat=True)) == sorted(r.value for r in Role)
    counts = [Group.objects.get(name=r.value).permissions.count() for r in ROLE_ORDER]
    assert counts == sorted(counts) and len(set(counts)) == 4
    for role in ROLE_ORDER:
        user = User.objects.get(username=role.value)
        assert user_role(user) is role
    assert AuditEvent.objects.filter(action="user.role_set").count() == 4


def test_each_role_holds_the_permissions_of_the_roles_below() -> None:
    for lower, higher in itertools.pairwise(ROLE_ORDER):
        assert set(role_permissions(lower)) < set(role_permissions(higher))


@pytest.mark.django_db
def test_only_operators_and_above_may_operate_nodes(viewer: User, operator: User) -> None:
    assert not viewer.has_perm("fleet.operate_node")
    assert operator.has_perm("fleet.operate_node")
