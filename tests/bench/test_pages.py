"""Pages at fleet scale: 5,000 nodes in 50 pools, 50 models of 10 versions, 10,000 operations,
20 rollouts and 100,000 audit events (`manage.py seed_fleet`); then as much again with ten times
the nodes and pools: 50,000 nodes in 500 pools. Median server time (the request through
Django, in process) and query count per page at each size. Target: under 150 ms each, on
PostgreSQL, and the same number of queries at both sizes."""

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
# What each size adds, and the prefix of its names.
SIZES = {
    "5,000 nodes": (Size(nodes=5_000, pools=50), ""),
    "50,000 nodes": (Size(nodes=45_000, pools=450), "more-"),
}


@pytest.mark.django_db
def test_pages_at_5000_and_50000_nodes(
    client: Client, admin_user: User, settings: object, report: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(admin_user)
    vendor = connection.vendor
    queries: dict[str, list[int]] = {}
    slow = []
    pages: dict[str, str] = {}
    for label, (size, prefix) in SIZES.items():
        t0 = time.perf_counter()
        seed_fleet(size=size, prefix=prefix)
        print(f"\n{label}: seeded in {time.perf_counter() - t0:.1f} s")
        pages = pages or _pages()  # at the first seeding's objects, both times
        for name, url in pages.items():
            times = []
            for _ in range(WARMUP + ROUNDS):
                with CaptureQueriesContext(connection) as captured:
                    t0 = time.perf_counter()
                    response = client.get(url)
                    times.append(time.perf_counter() - t0)
                assert response.status_code == 200, url
            median = statistics.median(times[WARMUP:]) * 1000
            queries.setdefault(name, []).append(len(captured))
            report.add(  # type: ignore[attr-defined]
                f"page at {label} ({vendor})",
                name,
                f"{median:.0f} ms, {len(captured)} queries",
                "< 150 ms",
            )
            if median >= 150:
                slow.append(f"{name} at {label}: {median:.0f} ms")
    assert not slow, slow
    grown = {name: counts for name, counts in queries.items() if len(set(counts)) > 1}
    assert not grown, f"queries per page at each size: {grown}"


def _pages() -> dict[str, str]:
    """The pages, a node's and a rollout's at the first ones seeded."""
    node = Node.objects.order_by("name").first()
    rollout = Rollout.objects.order_by("id").first()
    assert node and rollout
    return {
        "overview": "/",
        "nodes": "/nodes/",
        "nodes (drift filter)": "/nodes/?drift=1",
        "nodes (model filter)": "/nodes/?model=pipeline-00",
        "node detail": f"/nodes/{node.name}/",
        "models": "/models/",
        "model detail": "/models/pipeline-00/",
        "deployments": "/deployments/",
        "rollouts": "/rollouts/",
        "rollout detail": f"/rollouts/{rollout.pk}/",
        "audit": "/audit/",
        "timeline": "/audit/timeline/",
    }
