"""The statements a release runs for every load of every node are prepared once per connection
on PostgreSQL (apps/web/prepared.py), and counted and logged as Django's own are."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.fleet.lease import Lease
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.runner import _claim
from apps.web.prepared import prepared_cursor

pytestmark = pytest.mark.django_db


def _prepared() -> list[tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return cursor.fetchall()


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's"
)
def test_a_statement_is_prepared_once_and_then_run_without_planning_again() -> None:
    """Run six times, PostgreSQL holds it once, and runs it from a generic plan after the first
    five (its own rule); Django's own statements are neither prepared nor counted (psycopg
    would keep their text)."""
    pool = NodePool.objects.create(name="p")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://n1:8000")
    statement = "UPDATE fleet_node SET weight = %s WHERE id = %s"
    with CaptureQueriesContext(connection) as captured:
        for weight in range(6):
            with prepared_cursor() as cursor:
                cursor.execute(statement, (weight, node.pk))
                assert cursor.rowcount == 1
    Node.objects.filter(pk=node.pk).update(draining=True)
    assert connection.connection.prepare_threshold is None  # Django's own: not even counted
    assert _prepared() == [("UPDATE fleet_node SET weight = $1 WHERE id = $2", 6)]
    assert Node.objects.get(pk=node.pk).weight == 5
    logged = [q["sql"] for q in captured]
    assert len(logged) == 6 and logged[-1] == statement % (5, node.pk)


def test_a_node_lease_is_taken_and_given_back_through_prepared_statements() -> None:
    pool = NodePool.objects.create(name="p")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://n1:8000")
    with Lease(node.pk).hold() as lease:
        assert lease.held
        assert Node.objects.get(pk=node.pk).lease_owner == lease.owner
        assert Lease(node.pk)._take() == (False, False)  # held: another worker waits
    assert Node.objects.values_list("lease_owner", "lease_until").get() == ("", None)
    if connection.vendor == "postgresql":
        assert len(_prepared()) == 2  # the take and the release


def test_the_first_operation_is_claimed_with_the_lease_and_only_if_it_is_taken() -> None:
    pool = NodePool.objects.create(name="p")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://n1:8000")
    op = Operation.objects.create(
        node=node, kind="load", model_name="m", versions=[1], requested_by="system:reconciler"
    )
    with Lease(node.pk).hold():
        assert Lease(node.pk)._take(_claim(op)) == (False, False)  # another worker's node
    assert Operation.objects.values_list("status", "attempts").get() == ("queued", 0)
    with Lease(node.pk).hold(_claim(op)) as lease:
        assert (lease.held, lease.claimed) == (True, True)
        assert Operation.objects.values_list("status", "attempts").get() == ("running", 1)
