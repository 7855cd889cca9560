import io
import itertools

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client

from apps.accounts.models import PoolRole
from apps.accounts.roles import ROLE_ORDER, Role, role_permissions
from apps.accounts.services import user_role
from apps.audit.models import AuditEvent
from apps.fleet.models import NodePool


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


@pytest.mark.django_db
def test_an_admin_grants_and_revokes_a_pool_role_on_its_page(
    client: Client, admin_user: User, viewer: User
) -> None:
    NodePool.objects.create(name="gpu")
    client.force_login(admin_user)
    grant = {"user": "viewer-user", "pool": "gpu", "role": "release_manager"}
    granted = client.post("/pools/roles/", grant, follow=True)
    assert "viewer-user is now release manager of gpu." in granted.content.decode()
    listed = client.get("/pools/roles/?pool=gpu").content.decode()
    assert "<td>gpu</td><td>viewer-user</td><td>Release Manager</td>" in listed
    assert client.get("/pools/roles/?pool=cpu").content.decode().count("viewer-user") == 0
    client.post("/pools/roles/", grant | {"role": ""})
    assert not PoolRole.objects.exists()
    events = AuditEvent.objects.filter(action="user.set_pool_role").order_by("id")
    assert [(e.actor, e.after["role"]) for e in events] == [
        ("admin-user", "release_manager"),
        ("admin-user", ""),
    ]


@pytest.mark.django_db
def test_a_refused_grant_says_why_in_place_and_changes_nothing(
    client: Client, admin_user: User
) -> None:
    NodePool.objects.create(name="gpu")
    client.force_login(admin_user)
    htmx = client.post(
        "/pools/roles/",
        {"user": "ghost", "pool": "gpu", "role": "operator"},
        HTTP_HX_REQUEST="true",
    )
    assert (htmx.status_code, htmx.content.decode()) == (
        422,
        '<p class="flash error">no user named &#x27;ghost&#x27;</p>',
    )
    plain = client.post("/pools/roles/", {"user": "admin-user", "pool": "cpu", "role": "operator"})
    assert "no pool named &#x27;cpu&#x27;" in client.get(plain["Location"]).content.decode()
    assert not PoolRole.objects.exists()
