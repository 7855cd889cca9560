import io
import itertools

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command

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
    assert AuditEvent.objects.filter(action="user.set_role").count() == 4


def test_each_role_holds_the_permissions_of_the_roles_below() -> None:
    for lower, higher in itertools.pairwise(ROLE_ORDER):
        assert set(role_permissions(lower)) < set(role_permissions(higher))


@pytest.mark.django_db
def test_only_operators_and_above_may_operate_nodes(viewer: User, operator: User) -> None:
    assert not viewer.has_perm("fleet.operate_node")
    assert operator.has_perm("fleet.operate_node")


@pytest.mark.django_db
def test_a_pool_role_is_set_and_taken_away_by_command(viewer: User) -> None:
    from apps.accounts.models import PoolRole
    from apps.fleet.models import NodePool

    NodePool.objects.create(name="gpu")
    call_command("set_pool_role", "viewer-user", "gpu", "operator", stdout=io.StringIO())
    assert PoolRole.objects.get().role == "operator"
    call_command("set_pool_role", "viewer-user", "gpu", "none", stdout=io.StringIO())
    assert not PoolRole.objects.exists()
    User.objects.create_user("nobody")
    with pytest.raises(CommandError, match="nobody has no role: give them one"):
        call_command("set_pool_role", "nobody", "gpu", "operator")
    with pytest.raises(CommandError, match="no pool named 'cpu'"):
        call_command("set_pool_role", "viewer-user", "cpu", "operator")
    events = AuditEvent.objects.filter(action="user.set_pool_role", result="ok")
    assert [(e.before["role"], e.after["role"]) for e in events.order_by("id")] == [
        ("", "operator"),
        ("operator", ""),
    ]
