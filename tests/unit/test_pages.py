import re
from weakref import WeakKeyDictionary

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.fleet import desired, selectors
from apps.fleet.models import Node, NodePool

PAGES = [
    "/",
    "/nodes/",
    "/deployments/",
    "/models/",
    "/rollouts/",
    "/metrics/",
    "/audit/",
    "/audit/timeline/",
]


@pytest.mark.django_db
@pytest.mark.parametrize("url", [*PAGES, "/admin/"])
def test_anonymous_requests_redirect_to_login(client: Client, url: str) -> None:
    response = client.get(url)
    assert response.status_code == 302
    assert (
        response["Location"].startswith("/accounts/login/")
        or "/admin/login/" in response["Location"]
    )


@pytest.mark.parametrize("url", PAGES)
def test_every_page_answers_a_viewer_with_the_navigation(
    client: Client, viewer: User, url: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # nothing listens: charts must say so, not fail
    client.force_login(viewer)
    response = client.get(url)
    assert response.status_code == 200
    for label in [
        "Overview",
        "Nodes",
        "Deployments",
        "Models",
        "Rollouts",
        "Metrics",
        "Timeline",
        "Audit",
    ]:
        assert f">{label}</a>" in response.content.decode()


def test_htmx_gets_only_the_node_table(client: Client, viewer: User) -> None:
    pool = NodePool.objects.create(name="gpu-a")
    Node.objects.create(name="node-1", pool=pool, http_url="http://10.0.0.1:8000")
    client.force_login(viewer)
    body = client.get("/nodes/", headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<div id="node-table"')
    assert "node-1" in body and "<nav" not in body


def test_node_list_query_count_does_not_grow_with_nodes(client: Client, viewer: User) -> None:
    client.force_login(viewer)
    pool = NodePool.objects.create(name="gpu-a")

    def queries() -> int:
        """As a first view: a page shown again reuses the desired state and its shapes' rows."""
        desired._FLEETS.clear()
        with CaptureQueriesContext(connection) as captured:
            client.get("/nodes/", headers={"HX-Request": "true"})
        return len(captured)

    Node.objects.create(name="node-1", pool=pool, http_url="http://10.0.0.1:8000")
    one = queries()
    for i in range(2, 12):
        Node.objects.create(name=f"node-{i}", pool=pool, http_url=f"http://10.0.0.{i}:8000")
    assert queries() == one


def test_the_overview_shows_its_pools_a_page_at_a_time_and_sums_the_whole_fleet(
    client: Client, viewer: User
) -> None:
    pools = NodePool.objects.bulk_create(NodePool(name=f"pool-{i:03}") for i in range(60))
    Node.objects.bulk_create(
        Node(name=f"node-{i}", pool=pool, http_url="http://10.0.0.1:8000", health="ready")
        for i, pool in enumerate(pools)
    )
    client.force_login(viewer)
    first = client.get("/")
    rows = [p.pool.name for p in first.context["pools"]]
    assert (len(rows), rows[0], rows[-1]) == (50, "pool-000", "pool-049")
    assert first.context["summary"].ready == 60  # every pool's nodes, not the page's
    assert "Page 1 of 2" in first.content.decode()
    rows = [p.pool.name for p in client.get("/?page=2").context["pools"]]
    assert rows == [f"pool-{i:03}" for i in range(50, 60)]


def test_chart_fragment_says_prometheus_is_down(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"
    client.force_login(viewer)
    response = client.get("/metrics/?metric=p99", headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert "did not answer" in response.content.decode()


def test_pages_carry_a_content_security_policy_without_cdn(client: Client, viewer: User) -> None:
    client.force_login(viewer)
    response = client.get("/metrics/")
    assert "script-src 'self' 'nonce-" in response["Content-Security-Policy"]
    body = response.content.decode()
    assert "/static/plotly/plotly.min.js" in body
    assert "/static/django_htmx/htmx" in body or "htmx" in body
    assert "https://" not in body


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("range=custom&start=2026-11-02T10:00&end=2026-11-01T10:00", "must come after its start"),
        ("range=custom&start=2026-01-01T00:00&end=2026-11-01T00:00", "at most 30 days"),
        ("range=custom&start=yesterday&end=", "needs a start and an end"),
    ],
)
def test_a_bad_custom_range_says_what_is_wrong(
    client: Client, viewer: User, query: str, message: str
) -> None:
    client.force_login(viewer)
    response = client.get(f"/metrics/?metric=p99&{query}", headers={"HX-Request": "true"})
    assert response.status_code == 200 and message in response.content.decode()


def test_markers_are_the_changes_to_the_chosen_model(db: None) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.audit.services import audit_record
    from apps.observability.markers import change_markers

    audit_record(
        actor="ops", action="deployment.set", target="pool:demo:rag_pipeline", after={"version": 2}
    )
    audit_record(actor="ops", action="operation.load", target="node:demo-1:embedder")
    audit_record(actor="ops", action="user.set_role", target="user:ops")
    audit_record(actor="system:poller", action="node.down", target="node:demo-1", result="failed")
    audit_record(actor="system:poller", action="node.up", target="node:demo-10")
    audit_record(
        actor="ops", action="deployment.set", target="pool:demo:rag_pipeline", result="denied"
    )
    now = timezone.now()
    window = {"start": now - timedelta(minutes=5), "end": now + timedelta(minutes=1)}
    (marker,) = change_markers(**window, model="rag_pipeline")
    assert (marker.text, marker.label) == (
        "deploy rag_pipeline v2 on pool demo by ops",
        "deploy rag_pipeline v2",
    )
    labels = [m.label for m in change_markers(**window, node="demo-1")]
    assert labels == ["load embedder", "down demo-1"]  # not demo-10's
    # The load right after the deployment is told in the deployment's marker, not drawn apart.
    assert [m.label for m in change_markers(**window)] == [
        "deploy rag_pipeline v2",
        "down demo-1",
        "up demo-10",
    ]


def test_auto_refresh_makes_the_chart_fetch_itself_again(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    url = "/metrics/?metric=p99&range=1h"
    plain = client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert "hx-trigger" not in plain
    refreshing = client.get(f"{url}&refresh=on", headers={"HX-Request": "true"}).content.decode()
    assert 'hx-trigger="every 15s"' in refreshing
    assert 'hx-get="/metrics/?metric=p99&amp;range=1h&amp;refresh=on"' in refreshing


def test_the_serving_fragment_names_the_nodes_with_the_version_ready(
    client: Client, viewer: User
) -> None:
    """It was a 500: the node list joins the pool, which the fragment's query deferred."""
    pool = NodePool.objects.create(name="gpu")
    ready = [{"model": "embedder", "version": 2, "state": "READY", "reason": ""}]
    Node.objects.create(name="gpu-2", pool=pool, http_url="http://10.0.0.2:8000", index=ready)
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://10.0.0.1:8000", index=[])
    client.force_login(viewer)
    response = client.get("/nodes/serving/", {"model": "embedder", "version": "2"})
    assert response.status_code == 200
    body = response.content.decode()
    assert "gpu-2" in body and "gpu-1" not in body
    assert 'READY on <a href="/nodes/?pool=gpu&amp;model=embedder">1 node of gpu</a>' in body


def test_a_node_list_shown_again_reads_no_shape_it_has_seen_and_sees_a_change(
    client: Client, viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process that has shown no page yet: on SQLite an earlier test's pool had this one's id,
    # and its shape's row, kept, was this one's.
    monkeypatch.setattr(selectors, "_ROWS", WeakKeyDictionary())
    client.force_login(viewer)
    pool = NodePool.objects.create(name="gpu-a")
    for i in range(1, 4):
        Node.objects.create(name=f"node-{i}", pool=pool, http_url=f"http://10.0.0.{i}:8000")

    def page() -> tuple[str, int]:
        """The summary line (counted from the shapes) and the nodes' documents read (not the
        desired state's deployments, read with their nodes when it is first built)."""
        with CaptureQueriesContext(connection) as captured:
            html = client.get("/nodes/").content.decode()
        summary = re.search(r'id="node-summary">([^<]*)', html)
        assert summary
        reads = [q["sql"] for q in captured if 'FROM "fleet_node"' in q["sql"]]
        return summary[1], sum('"fleet_node"."index"' in sql for sql in reads)

    summary, first = page()
    assert "0 drifting" in summary
    summary, again = page()
    assert again == first - 1 and "0 drifting" in summary  # the shape seen: its row kept
    # A node's index changes (someone loaded a model): a new shape, read and counted.
    stray = [{"model": "stray", "version": "1", "state": "READY", "reason": ""}]
    Node.objects.filter(name="node-2").update(index=stray)
    summary, changed = page()
    assert changed == first and "1 drifting" in summary
