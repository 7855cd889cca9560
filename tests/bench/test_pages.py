"""Pages at fleet scale: 5,000 nodes in 50 pools, 50 models of 10 versions, 10,000 operations,
20 rollouts and 100,000 audit events (`manage.py seed_fleet`). Median server time (the request
through Django, in process) and query count per page. Target: under 150 ms each, on PostgreSQL."""

import statistics
import time

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.devtools.seed import Size, seed_fleet
from apps.fleet.models import Node
from apps.rollouts.models import Rollout

ROUNDS = 15
WARMUP = 3


@pytest.mark.django_db
def test_pages_at_5000_nodes(
    client: Client, admin_user: User, settings: object, report: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    seed_fleet(size=Size(nodes=5_000, pools=50))
    seeded = time.perf_counter() - t0
    client.force_login(admin_user)
    node = Node.objects.order_by("name").first()
    rollout = Rollout.objects.order_by("id").first()
    assert node and rollout
    pages = {
        "overview": "/",
        "nodes": "/nodes/",
        "nodes (drift filter)": "/nodes/?drift=1",
        "node detail": f"/nodes/{node.name}/",
        "models": "/models/",
        "model detail": "/models/pipeline-00/",
        "deployments": "/deployments/",
        "rollouts": "/rollouts/",
        "rollout detail": f"/rollouts/{rollout.pk}/",
        "audit": "/audit/",
        "timeline": "/audit/timeline/",
    }
    vendor = connection.vendor
    slow = []
    for name, url in pages.items():
        times = []
        for _ in range(WARMUP + ROUNDS):
            with CaptureQueriesContext(connection) as captured:
                t0 = time.perf_counter()
                response = client.get(url)
                times.append(time.perf_counter() - t0)
            assert response.status_code == 200, url
        median = statistics.median(times[WARMUP:]) * 1000
        report.add(  # type: ignore[attr-defined]
            f"page at 5,000 nodes ({vendor})",
            name,
            f"{median:.0f} ms, {len(captured)} queries",
            "< 150 ms",
        )
        if median >= 150:
            slow.append(f"{name} {median:.0f} ms")
    print(f"\nseeded in {seeded:.1f} s")
    assert not slow, slow
