"""The control plane's own /metrics: exact values read from the database and Redis at scrape
time, a query count flat in fleet size, a token (or an explicit opt-in) to read them, and a
scrape that still answers when the broker does not."""

import math
import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.models import ApiToken
from apps.accounts.services import token_create, token_revoke
from apps.api import metrics
from apps.fleet.models import Heartbeat, Node, NodePool, Operation
from apps.fleet.tasks import heartbeat
from apps.registry.models import Model
from apps.rollouts.models import Measurement, Notification, Rollout
from apps.rollouts.tasks import advance_all
from controlplane.celery import app as celery_app
from tests.support.metrics import make_fleet, matching, operation, scrape, scrape_headers

pytestmark = pytest.mark.django_db


@pytest.fixture
def headers(viewer: User) -> dict[str, str]:
    return scrape_headers(viewer)


def test_every_series_reports_exact_values_from_the_database(
    client: Client, headers: dict[str, str]
) -> None:
    gpu, eu = NodePool.objects.create(name="gpu-a"), NodePool.objects.create(name="eu-west")
    a1, _, a3 = (
        Node.objects.create(name=name, pool=gpu, http_url="http://127.0.0.1:1", health=health)
        for name, health in [("a1", "ready"), ("a2", "ready"), ("a3", "unreachable")]
    )
    e1 = Node.objects.create(name="e1", pool=eu, http_url="http://127.0.0.1:1", health="live")
    for name, stage in [("e2", "joining"), ("e3", "departed")]:  # gone: not counted unreachable
        Node.objects.create(
            name=name, pool=eu, http_url="http://127.0.0.1:1", health="unreachable", stage=stage
        )
    operation(a1, "load", "succeeded", took_s=3)
    operation(a1, "load", "failed", took_s=0.5)
    operation(a3, "unload", "unknown", took_s=1.5)
    operation(a1, "reload", "cancelled")  # never started: no duration
    old = operation(e1, "load", "queued")
    Operation.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(seconds=120))
    operation(e1, "reload", "running")

    m1, m2 = Model.objects.create(name="m1"), Model.objects.create(name="m2")
    plan = [{"percent": 100}]
    live = Rollout.objects.create(
        model=m1, pool=gpu, baseline_version=1, canary_version=2, plan=plan, state="progressing"
    )
    Rollout.objects.create(
        model=m2, pool=gpu, baseline_version=1, canary_version=2, plan=plan, state="succeeded"
    )
    Rollout.objects.create(
        model=m1, pool=eu, baseline_version=1, canary_version=2, plan=plan, state="rolled_back"
    )
    for verdict in ["success", "success", "failure"]:
        Measurement.objects.create(
            rollout=live, step=0, kind="latency", metric="p99", query="q", verdict=verdict
        )
    for status in ["sent", "failed", "failed"]:
        Notification.objects.create(rollout=live, event="started", payload={}, status=status)

    samples = scrape(client, headers)

    assert matching(samples, "controlplane_rollouts") == {
        ("pending",): 0,
        ("progressing",): 1,
        ("paused",): 0,
        ("promoting",): 0,
        ("succeeded",): 1,
        ("aborting",): 0,
        ("rolled_back",): 1,
        ("failed",): 0,
    }
    assert matching(samples, "controlplane_operations") == {
        ("queued",): 1,
        ("running",): 1,
        ("succeeded",): 1,
        ("failed",): 1,
        ("unknown",): 1,
        ("cancelled",): 1,
    }
    assert matching(samples, "controlplane_operation_duration_seconds") == {
        ("load",): 1.75,
        ("unload",): 1.5,
        ("reload",): 0,
    }
    lag = matching(samples, "controlplane_reconcile_lag_seconds")
    assert lag.keys() == {("gpu-a",), ("eu-west",)}
    assert lag[("gpu-a",)] == 0
    assert lag[("eu-west",)] == pytest.approx(120, abs=10)
    assert matching(samples, "controlplane_nodes") == {
        ("unknown", "eu-west"): 0,
        ("ready", "eu-west"): 0,
        ("live", "eu-west"): 1,
        ("unreachable", "eu-west"): 1,
        ("unknown", "gpu-a"): 0,
        ("ready", "gpu-a"): 2,
        ("live", "gpu-a"): 0,
        ("unreachable", "gpu-a"): 1,
    }
    assert matching(samples, "controlplane_node_stages") == {
        ("eu-west", "joining"): 1,
        ("eu-west", "serving"): 1,
        ("eu-west", "quarantined"): 0,
        ("eu-west", "departed"): 1,
        ("gpu-a", "joining"): 0,
        ("gpu-a", "serving"): 3,
        ("gpu-a", "quarantined"): 0,
        ("gpu-a", "departed"): 0,
    }
    assert matching(samples, "controlplane_analysis_verdicts") == {
        ("success",): 2,
        ("marginal",): 0,
        ("failure",): 1,
        ("inconclusive",): 0,
        ("error",): 0,
    }
    assert matching(samples, "controlplane_webhook_deliveries") == {
        ("pending",): 0,
        ("sent",): 1,
        ("failed",): 2,
    }


def test_a_scrape_runs_as_many_queries_for_a_big_fleet_as_for_a_small_one(
    client: Client, settings: object
) -> None:
    settings.METRICS_ALLOW_ANONYMOUS = True  # type: ignore[attr-defined]
    make_fleet("small", nodes=1)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/metrics").status_code == 200
        return len(captured)

    small = queries()
    for i in range(6):
        make_fleet(f"big-{i}", nodes=5, queue=f"q{i}")
    assert queries() == small


def test_a_scrape_needs_a_live_token(client: Client, viewer: User) -> None:
    record, value = token_create(
        user=viewer, name="prometheus", actor="system:test", scope=ApiToken.Scope.READ
    )
    refused = client.get("/metrics")
    assert refused.status_code == 401
    assert refused["WWW-Authenticate"].startswith("Bearer")
    assert b"controlplane_" not in refused.content
    assert client.get("/metrics", headers={"Authorization": f"Bearer {value}"}).status_code == 200
    token_revoke(token_id=record.pk, actor="system:test")
    assert client.get("/metrics", headers={"Authorization": f"Bearer {value}"}).status_code == 401


def test_anonymous_scrapes_only_where_the_setting_allows_them(
    client: Client, settings: object
) -> None:
    assert client.get("/metrics").status_code == 401
    settings.METRICS_ALLOW_ANONYMOUS = True  # type: ignore[attr-defined]
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "no-cache" in response["Cache-Control"]
    # A token that was sent is still checked: a mistyped one shows up as a failing target.
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_the_charts_page_behind_the_slash_still_asks_for_a_login(client: Client) -> None:
    response = client.get("/metrics/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_a_scrape_is_a_read(client: Client, headers: dict[str, str]) -> None:
    response = client.post("/metrics", "{}", content_type="application/json", headers=headers)
    assert response.status_code == 405


def test_the_rollout_tick_lag_and_the_heartbeat_age_are_reported(
    client: Client, headers: dict[str, str], settings: object
) -> None:
    settings.READY_HEARTBEAT_MAX_AGE_S = 60  # type: ignore[attr-defined]
    settings.ROLLOUT_TICK_S = 2  # type: ignore[attr-defined]
    samples = scrape(client, headers)
    # Before the first tick and the first heartbeat: infinitely late, never "just now".
    assert matching(samples, "controlplane_rollout_tick_age_seconds") == {(): math.inf}
    assert matching(samples, "controlplane_heartbeat_age_seconds") == {(): math.inf}
    assert matching(samples, "controlplane_workers_up") == {(): 0}
    assert matching(samples, "controlplane_rollout_tick_interval_seconds") == {(): 2}

    advance_all.apply()  # a tick, as a worker of the rollouts queue runs it for beat
    heartbeat.apply()
    samples = scrape(client, headers)
    assert matching(samples, "controlplane_rollout_tick_age_seconds")[()] < 5
    assert matching(samples, "controlplane_heartbeat_age_seconds")[()] < 5
    assert matching(samples, "controlplane_workers_up") == {(): 1}

    Heartbeat.objects.update(at=timezone.now() - timedelta(seconds=90))
    samples = scrape(client, headers)
    assert matching(samples, "controlplane_rollout_tick_age_seconds")[()] == pytest.approx(
        90, abs=5
    )
    assert matching(samples, "controlplane_workers_up") == {(): 0}


def test_every_live_token_shows_when_it_expires(
    client: Client, headers: dict[str, str], viewer: User, operator: User
) -> None:
    alerts, _ = token_create(
        user=operator, name="alertmanager", actor="system:test", scope=ApiToken.Scope.ALERTS
    )
    short, _ = token_create(user=viewer, name="ci", actor="system:test", days=3)
    gone, _ = token_create(user=viewer, name="old", actor="system:test")
    token_revoke(token_id=gone.pk, actor="system:test")
    long_expired, _ = token_create(user=viewer, name="ancient", actor="system:test")
    ApiToken.objects.filter(pk=long_expired.pk).update(
        expires_at=timezone.now() - timedelta(days=30)
    )
    prometheus = ApiToken.objects.get(name="prometheus")

    expiry = matching(scrape(client, headers), "controlplane_api_token_expiry_timestamp_seconds")
    # Labels in name order: name, scope, token, user.
    assert expiry == {
        ("prometheus", "read", str(prometheus.pk), viewer.username): pytest.approx(
            prometheus.expires_at.timestamp()
        ),
        ("alertmanager", "alerts", str(alerts.pk), operator.username): pytest.approx(
            alerts.expires_at.timestamp()
        ),
        ("ci", "write", str(short.pk), viewer.username): pytest.approx(
            short.expires_at.timestamp()
        ),
    }


def test_the_number_of_token_series_is_capped(
    client: Client, headers: dict[str, str], viewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "TOKENS_SHOWN", 3)
    soonest = [
        token_create(user=viewer, name=f"script {i}", actor="system:test", days=1 + i)[0]
        for i in range(5)
    ]
    expiry = matching(scrape(client, headers), "controlplane_api_token_expiry_timestamp_seconds")
    assert {labels[2] for labels in expiry} == {str(t.pk) for t in soonest[:3]}


def test_an_alerts_token_may_not_scrape(client: Client, operator: User) -> None:
    _, value = token_create(
        user=operator, name="alertmanager", actor="system:test", scope=ApiToken.Scope.ALERTS
    )
    response = client.get("/metrics", headers={"Authorization": f"Bearer {value}"})
    assert response.status_code == 403
    assert b"controlplane_" not in response.content


HISTORY = (Operation, Rollout, Measurement, Notification)


def history(pool: NodePool, n: int) -> None:
    """`n` finished operations and rollouts, each with a measurement and a webhook delivery."""
    node = pool.nodes.first()
    assert node is not None
    model, _ = Model.objects.get_or_create(name="history")
    for _ in range(n):
        operation(node, "load", "succeeded", took_s=1)
        rollout = Rollout.objects.create(
            model=model,
            pool=pool,
            baseline_version=1,
            canary_version=2,
            plan=[{"percent": 100}],
            state="succeeded",
        )
        Measurement.objects.create(rollout=rollout, step=0, kind="latency", metric="p99", query="q")
        Notification.objects.create(rollout=rollout, event="started", payload={}, status="sent")


def plans(queries: list[str]) -> list[str]:
    """Each query with the plan the database chooses for it."""
    found = []
    with connection.cursor() as cursor:
        for sql in queries:
            if connection.vendor == "postgresql":
                cursor.execute("EXPLAIN " + sql)
                plan = "\n".join(row[0] for row in cursor.fetchall())
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + sql)
                plan = "\n".join(str(row[-1]) for row in cursor.fetchall())
            found.append(f"{sql}\n{plan}")
    return found


def full_scans(queries: list[str]) -> list[str]:
    """The queries whose plan reads a history table end to end: on SQLite, a SCAN of the table
    or of an index of all its rows (one with a condition, as the open operations', holds a few)."""
    tables = {model._meta.db_table for model in HISTORY}
    if connection.vendor == "postgresql":
        pattern = r"Seq Scan on (\w+)()"
    else:
        pattern = r"^SCAN (\w+)(?: USING (?:COVERING )?INDEX (\w+))?"
    partial = {index.name for model in HISTORY for index in model._meta.indexes if index.condition}
    return [
        plan
        for plan in plans(queries)
        if any(
            table in tables and index not in partial
            for table, index in re.findall(pattern, plan, re.M)
        )
    ]


def rows_read() -> dict[str, int]:
    """Rows PostgreSQL read from each history table in this transaction, by sequential and by
    index scans."""
    tables = [model._meta.db_table for model in HISTORY]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, seq_tup_read, coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [tables],
        )
        return {name: seq + fetched for name, seq, fetched in cursor.fetchall()}


def test_a_scrape_reads_as_many_rows_after_a_long_history_as_after_a_short_one(
    client: Client, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.METRICS_ALLOW_ANONYMOUS = True  # type: ignore[attr-defined]
    monkeypatch.setattr(metrics, "RECENT_ROWS", 20)
    pool = make_fleet("gpu-a", nodes=2)
    if connection.vendor == "postgresql":
        # Tables this small fit a page or two: the planner would rightly scan them whole. Told
        # to use an index where one serves, it shows what the queries cost at scale.
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")

    def scrape_cost() -> tuple[int, dict[str, int], list[str]]:
        before = rows_read() if connection.vendor == "postgresql" else {}
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/metrics").status_code == 200
        after = rows_read() if connection.vendor == "postgresql" else {}
        read = {table: n - before.get(table, 0) for table, n in after.items()}
        return len(captured), read, [q["sql"] for q in captured]

    history(pool, 25)  # more than RECENT_ROWS already
    short_queries, short_rows, _ = scrape_cost()
    history(pool, 250)
    long_queries, long_rows, sqls = scrape_cost()
    assert long_queries == short_queries
    assert long_rows == short_rows, (long_rows, short_rows)
    assert full_scans(sqls) == []


def test_a_broker_nothing_answers_at_leaves_the_scrape_up_without_queue_depths(
    client: Client, headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/integration/test_self_metrics.py has one that accepts and never answers."""
    monkeypatch.setattr(celery_app.conf, "broker_url", "redis://127.0.0.1:1/0")
    make_fleet("gpu-a", nodes=1, queue="gpu")
    samples = scrape(client, headers)
    assert matching(samples, "controlplane_broker_up") == {(): 0}
    assert matching(samples, "controlplane_celery_queue_depth") == {}
    assert matching(samples, "controlplane_nodes")[("ready", "gpu-a")] == 1
