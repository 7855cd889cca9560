"""Costs flat in fleet size: each page and API list sends as many queries for a big fleet as for
a small one, and the desired state of a whole pool costs as much as one node's."""

from datetime import timedelta

from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.services import token_create
from apps.fleet.desired import fleet_desired
from apps.fleet.models import Node, NodePool
from apps.incidents.models import Incident
from apps.registry.models import Model
from apps.rollouts.models import Approval, Rollout
from apps.rollouts.seed import Size, seed_fleet

SMALL = Size(nodes=4, pools=2, models=10, versions=3, operations=20, rollouts=2, events=30)
BIGGER = Size(nodes=60, pools=3, models=15, versions=4, operations=300, rollouts=9, events=900)


def pages() -> list[str]:
    node = Node.objects.order_by("name").first()
    rollout = Rollout.objects.order_by("id").first()
    incident = Incident.objects.order_by("id").first()
    pool = NodePool.objects.annotate(size=Count("nodes")).order_by("-size", "id").first()
    assert node and rollout and incident and pool
    return [
        "/",
        "/nodes/",
        "/nodes/?drift=1",
        f"/nodes/{node.name}/",
        "/deployments/",
        f"/pools/{pool.name}/capacity/",  # the largest pool
        f"/pools/{pool.name}/fit/?model_version=a-model-000:2",
        "/models/",
        "/models/a-model-000/",
        "/rollouts/",
        f"/rollouts/{rollout.pk}/",
        "/rollouts/approvals/",
        "/audit/",
        "/audit/timeline/",
        "/incidents/",
        f"/incidents/{incident.pk}/",
        f"/incidents/{incident.pk}/report.md",
        "/api/nodes",
        "/api/deployments",
        "/api/rollouts",
        "/api/audit",
        "/api/operations",
        "/api/models",
        "/api/approvals",
    ]


def approvals(n: int, prefix: str) -> None:
    """`n` changes to protected pools, by as many people, half of them approved by others."""
    pool = NodePool.objects.order_by("id").last()
    for i in range(n):
        ann, bob = (User.objects.create(username=f"{prefix}{who}{i}") for who in "ab")
        Approval.objects.create(
            pool=pool,
            action="deployment.set",
            params={"pool": pool.name, "model": "m", "version": i},
            requested_by=ann,
            expires_at=timezone.now(),
            approved_by=bob if i % 2 else None,
            status=Approval.Status.APPROVED if i % 2 else Approval.Status.PENDING,
        )


def incidents(n: int, prefix: str) -> None:
    """`n` incidents over the last hour, every one in the same pool and model."""
    pool, model = NodePool.objects.order_by("id").first(), Model.objects.order_by("id").first()
    for i in range(n):
        start = timezone.now() - timedelta(minutes=i)
        Incident.objects.create(
            title=f"{prefix}{i}", started_at=start, opened_by="t", pool=pool, model=model
        )


def count(client: Client, url: str, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}"} if url.startswith("/api/") else {}
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, headers=headers)
    assert response.status_code == 200, (url, response.status_code)
    return len(captured)


def test_every_page_and_api_list_costs_the_same_queries_at_any_fleet_size(
    client: Client, admin_user: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(admin_user)
    _, token = token_create(user=admin_user, name="ci", actor="system:test")
    seed_fleet(size=SMALL, prefix="a-")
    approvals(2, "a-")
    incidents(2, "a-")
    small = {at: count(client, url, token) for at, url in enumerate(pages())}
    seed_fleet(size=BIGGER, prefix="b-")
    approvals(20, "b-")
    incidents(30, "b-")
    urls = pages()
    big = {at: count(client, url, token) for at, url in enumerate(urls)}
    assert big == small, [(urls[at], small[at], n) for at, n in big.items() if small[at] != n]


def test_a_pools_desired_state_costs_the_same_for_any_number_of_nodes(db: None) -> None:
    seed_fleet(size=SMALL, prefix="a-")

    def queries(pool: NodePool) -> tuple[int, int]:
        with CaptureQueriesContext(connection) as captured:
            desired = fleet_desired(pool_ids=[pool.pk])
            states = [desired.of(node) for node in pool.nodes.all()]
        assert all(states)
        return len(captured), len(states)

    few, few_nodes = queries(NodePool.objects.get(name="a-pool-00"))
    seed_fleet(size=BIGGER, prefix="b-")
    many, many_nodes = queries(NodePool.objects.get(name="b-pool-00"))
    assert many_nodes > 5 * few_nodes
    assert many == few
