"""One clock, the database's: a host whose own clock runs ahead (or behind) takes no lease still
held, lets no pin or owner's term lapse early, and keeps no approval past its time."""

from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone

from apps.accounts.roles import Role
from apps.approvals.models import Approval
from apps.approvals.services import ApprovalError, approval_withdraw
from apps.degradation.models import Tiers
from apps.fleet.lease import Lease
from apps.fleet.models import Node, NodePool, PoolOwner
from apps.fleet.owners import owner_holding
from apps.registry.models import Model
from apps.web.clock import database_now
from tests.support.users import make_user

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite is one host's file"),
]


@pytest.fixture
def skewed() -> Iterator[mock.Mock]:
    """This host's clock, set apart from the database's by the test."""
    real = timezone.now
    with mock.patch("django.utils.timezone.now") as now:
        now.side_effect = lambda: real() + now.skew
        now.skew = timedelta(0)
        yield now


def test_a_host_ahead_takes_no_lease_still_held_and_one_behind_takes_a_lapsed_one(
    skewed: mock.Mock,
) -> None:
    node = Node.objects.create(
        name="n1", pool=NodePool.objects.create(name="gpu"), http_url="http://127.0.0.1:1"
    )
    held = Node.objects.filter(pk=node.pk)
    held.update(lease_owner="other", lease_until=database_now() + timedelta(seconds=30))
    skewed.skew = timedelta(hours=1)
    assert Lease(node.pk)._take() == (False, False)
    assert held.get().lease_owner == "other"

    held.update(lease_until=database_now() - timedelta(seconds=1))
    skewed.skew = -timedelta(hours=1)
    taker = Lease(node.pk)
    assert taker._take() == (True, False)
    lease = held.get()
    assert lease.lease_owner == taker.owner
    assert lease.lease_until > database_now() + timedelta(seconds=taker.seconds - 5)


def test_a_host_ahead_lets_no_pin_or_owner_lapse_and_keeps_an_approval_alive(
    skewed: mock.Mock,
) -> None:
    pool, model = NodePool.objects.create(name="gpu"), Model.objects.create(name="rag")
    hour = database_now() + timedelta(hours=1)
    tiers = Tiers.objects.create(
        pool=pool, model=model, versions=[2, 1], pinned=1, pinned_until=hour
    )
    PoolOwner.objects.create(
        pool=pool,
        model=model,
        kind="pin",
        ref="pin",
        why="pinned",
        by="ann",
        since=hour,
        until=hour,
    )
    ann = make_user(Role.RELEASE_MANAGER)
    asked = Approval.objects.create(
        pool=pool, action="deployment.set", params={}, requested_by=ann, expires_at=hour
    )
    skewed.skew = timedelta(hours=2)
    assert tiers.pin_holds()
    assert owner_holding(pool, model) is not None
    assert approval_withdraw(approval_id=asked.pk, actor=ann).status == "withdrawn"

    skewed.skew = timedelta(0)
    late = Approval.objects.create(
        pool=pool, action="deployment.set", params={}, requested_by=ann, expires_at=hour
    )
    Approval.objects.filter(pk=late.pk).update(expires_at=database_now() - timedelta(seconds=1))
    skewed.skew = -timedelta(hours=2)
    with pytest.raises(ApprovalError, match="expired"):
        approval_withdraw(approval_id=late.pk, actor=ann)
