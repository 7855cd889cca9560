"""The incident timeline: its windows (around a given time, an operation's span), what changed
in one, its charts and its Markdown report."""

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool, Operation
from apps.incidents import timeline, views
from apps.registry.models import Model
from apps.rollouts.models import Measurement, Rollout, Round
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import record
from tests.support.users import bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def earlier(db: None, monkeypatch: pytest.MonkeyPatch) -> AuditEvent:
    """An event three hours ago: outside the last hour, inside a window around its time.
    Written then, since the trail refuses to be changed afterwards (on PostgreSQL)."""
    then = timezone.now() - timedelta(hours=3)
    with monkeypatch.context() as patched:
        patched.setattr(timezone, "now", lambda: then)
        return audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")


def test_a_window_around_a_given_time_holds_what_happened_then(
    client: Client, viewer: User, earlier: AuditEvent, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    assert "pool:gpu:rag" not in client.get("/audit/timeline/").content.decode()
    at = f"{earlier.created_at + timedelta(minutes=20):%Y-%m-%dT%H:%M}"
    page = client.get("/audit/timeline/", {"at": at, "window": "1h"}).content.decode()
    assert "1h around" in page and "<strong>deployment.set</strong> pool:gpu:rag" in page
    narrow = client.get("/audit/timeline/", {"at": at, "window": "1h"})
    assert narrow.context["end"] - narrow.context["start"] == timedelta(hours=1)
    bad = client.get("/audit/timeline/", {"at": "yesterday"}).content.decode()
    assert "at: expected a date and time" in bad and "last 1h" in bad


def test_an_operation_opens_the_timeline_on_its_span(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    node = Node.objects.create(
        name="gpu-1", pool=NodePool.objects.create(name="gpu"), http_url="http://127.0.0.1:1"
    )
    op = Operation.objects.create(
        node=node, kind="load", model_name="rag", versions=[2], status="failed", requested_by="ops"
    )
    audit_record(actor="system:worker", action="operation.load", target="node:gpu-1:rag")
    client.force_login(viewer)
    assert (
        f'href="/audit/timeline/?operation={op.pk}"' in client.get("/nodes/gpu-1/").content.decode()
    )
    page = client.get("/audit/timeline/", {"operation": op.pk})
    assert f"operation #{op.pk}: load rag [2] on gpu-1" in page.content.decode()
    assert page.context["start"] == op.created_at - timedelta(minutes=5)
    assert page.context["model"] == "rag"  # its chart comes first


def test_a_rollouts_verdicts_read_as_one_line_per_change(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    model = Model.objects.create(name="rag")
    rollout = Rollout.objects.create(
        model=model,
        pool=NodePool.objects.create(name="gpu"),
        baseline_version=1,
        canary_version=3,
        plan=[{"nodes": 1, "hold_s": 60}, {"percent": 100}],
        started_by="ops",
    )
    began = timezone.now() - timedelta(minutes=3)
    rounds = [
        ("success", ["success", "success"]),
        ("success", ["success", "success"]),
        ("marginal", ["success", "marginal"]),  # the round's own verdict, whatever its parts
        ("failure", ["success", "failure"]),
    ]
    kinds = [(Kind.ERRORS, "error_ratio"), (Kind.LATENCY, "p99")]
    for number, (overall, verdicts) in enumerate(rounds):
        results = [
            Result(
                metric,
                "q",
                312.0 if verdict == "failure" else 20.0,
                None,
                250.0,
                verdict,
                "",
                kind=kind,
            )
            for (kind, metric), verdict in zip(kinds, verdicts, strict=True)
        ]
        made = record(rollout, results, overall)
        Round.objects.filter(pk=made.pk).update(taken_at=began + timedelta(seconds=10 * number))
    client.force_login(viewer)
    page = client.get("/audit/timeline/", {"rollout": rollout.pk}).content.decode()
    lines = re.findall(
        r"<strong>rollout.verdict</strong>.*?<div class=\"small muted\">([^<]*)<", page
    )
    assert lines == [
        "step 1: success",
        "step 1: marginal; p99 20 (threshold 250)",
        "step 1: failure; p99 312 (threshold 250)",
    ]


@pytest.mark.parametrize("url", ["/audit/timeline/", "/audit/timeline/report.md"])
@pytest.mark.parametrize(
    ("query", "error"),
    [
        ({"at": "9999-12-31T23:00", "window": "24h"}, "at: expected a date and time"),
        ({"at": "0001-01-01T00:10"}, "at: expected a date and time"),
        ({"start": "2026-01-01T00:00", "end": "2026-03-01T00:00"}, "31 days apart at most"),
        ({"start": "2026-01-01T00:00", "end": "9999-12-31T23:59"}, "31 days apart at most"),
        ({"start": "2026-03-01T00:00", "end": "2026-01-01T00:00"}, "a start before the end"),
    ],
)
def test_a_window_out_of_range_or_too_long_shows_the_latest_and_says_why(
    client: Client, viewer: User, settings: object, url: str, query: dict, error: str
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    response = client.get(url, query)
    assert response.status_code == 200
    start, end = response.context["start"], response.context["end"]
    assert end <= timezone.now() and end - start == timedelta(
        hours=int(query.get("window", "1h")[:-1])
    )
    assert error in response.context["error"]


def test_the_timeline_sums_up_and_exports_a_markdown_report(
    trail: list[AuditEvent], client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    page = client.get("/audit/timeline/?window=1h").content.decode()
    assert "<strong>pool:gpu:rag</strong>: v1 → v2" in page
    report = client.get("/audit/timeline/report.md?window=1h")
    text = report.content.decode()
    assert report["Content-Type"].startswith("text/markdown")
    assert "- `pool:gpu:rag`: v1 -> v2" in text
    assert (
        "| system:rollouts | `rollout.aborting` | `rollout:7:rag` | ok | failure: p99 \\| above threshold |"
        in text
    )
    assert "/audit/timeline/?start=" in text  # the permalink to the same window


def test_the_timeline_charts_each_model_and_node_its_events_touched(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    for target in ["pool:gpu:rag", "node:gpu-2:ocr", "node:gpu-3", "model:asr:v4", "user:ops"]:
        audit_record(actor="ops", action="deployment.set", target=target)
    client.force_login(viewer)
    page = client.get("/audit/timeline/?window=1h").content.decode()
    urls = re.findall(r'hx-get="/audit/timeline/chart/\?([^"]+)"', page)
    subjects = [re.sub(r"start=[^&]+&amp;end=[^&]+&amp;", "", url) for url in urls]
    assert subjects == ["model=rag", "model=ocr", "model=asr", "node=gpu-2", "node=gpu-3"]
    chart = client.get("/audit/timeline/chart/?" + urls[3].replace("&amp;", "&")).content.decode()
    assert "P99 latency: node gpu-2" in chart and "did not answer" in chart
    bad = client.get("/audit/timeline/chart/?start=2026-11-30T02:00&end=2026-11-30T01:00")
    assert "needs a start before its end" in bad.content.decode()
    # The window asked for by model puts that model first; an empty window charts the fleet.
    now = timezone.now()
    window = {
        "start": f"{now - timedelta(days=10):%Y-%m-%dT%H:%M:%S}",
        "end": f"{now + timedelta(days=1):%Y-%m-%dT%H:%M:%S}",
    }
    page = client.get("/audit/timeline/", {**window, "model": "asr"}).content.decode()
    assert re.findall(r'hx-get="/audit/timeline/chart/\?[^"]+&amp;(\w+=[\w-]+)"', page)[:2] == [
        "model=asr",
        "model=rag",
    ]
    page = client.get("/audit/timeline/", {"start": "2026-01-01T00:00", "end": "2026-01-02T00:00"})
    (url,) = re.findall(r'hx-get="/audit/timeline/chart/\?([^"]+)"', page.content.decode())
    assert "model=" not in url and "node=" not in url


def test_a_busy_window_shows_its_first_events_and_links_the_rest(
    client: Client, viewer: User, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    monkeypatch.setattr(timeline, "MAX_EVENTS", 3)
    monkeypatch.setattr(views, "MAX_EVENTS", 3)
    for number in range(5):
        audit_record(actor="ops", action="node.drain", target=f"node:n{number}")
    client.force_login(viewer)
    page = client.get("/audit/timeline/?window=1h")
    trail = [e.target for e in AuditEvent.objects.order_by("created_at", "id")]
    assert len(trail) > 3 and [e.target for e in page.context["events"]] == trail[:3]
    assert "more than 3 events" in page.content.decode()
    rest = client.get(page.context["more"]).context["events"]
    assert [e.target for e in rest][-2:] == ["node:n3", "node:n4"]
    answer = client.get("/api/timeline", headers=bearer(viewer)).json()
    assert len(answer["events"]) == 3 and answer["more_from"]
    report = client.get("/audit/timeline/report.md?window=1h").content.decode()
    assert "More than 3 events: the rest of the window is at http" in report


@pytest.mark.django_db(transaction=True)
def test_measurements_from_before_rounds_were_rows_become_their_rounds(
    migrator: MigrationExecutor,
) -> None:
    """A round was its measurements written within one tick: the migration makes each a row,
    numbered in its step, with its worst verdict and its kind."""
    before, after = [("rollouts", "0017_rollouts_own_their_pools")], [("rollouts", "0018_rounds")]
    executor = migrator
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    rollout = _rollout_then(old)
    began = timezone.now() - timedelta(minutes=3)
    rows = [  # (seconds after, step, metric, verdict)
        (0.0, 0, "quality before traffic", "success"),
        (10.0, 0, "p99", "success"),
        (10.1, 0, "requests", "failure"),
        (20.0, 0, "p99", "success"),
        (30.0, 1, "p99", "inconclusive"),
    ]
    for seconds, step, metric, verdict in rows:
        made = old.get_model("rollouts", "Measurement").objects.create(
            rollout=rollout, step=step, metric=metric, verdict=verdict
        )
        old.get_model("rollouts", "Measurement").objects.filter(pk=made.pk).update(
            taken_at=began + timedelta(seconds=seconds)
        )
    MigrationExecutor(connection).migrate(after)
    found = Round.objects.filter(rollout_id=rollout.pk).order_by("taken_at")
    assert [(r.step, r.number, r.kind, r.verdict) for r in found] == [
        (0, 1, "gate", "success"),
        (0, 2, "analysis", "failure"),
        (0, 3, "analysis", "success"),
        (1, 1, "analysis", "inconclusive"),
    ]
    assert not Measurement.objects.filter(rollout_id=rollout.pk, round=None).exists()
    assert found[1].measurements.count() == 2


@pytest.mark.django_db(transaction=True)
def test_measurements_get_their_kind_from_the_names_rounds_gave_them(
    migrator: MigrationExecutor,
) -> None:
    before, after = [("rollouts", "0018_rounds")], [("rollouts", "0019_measurement_kinds")]
    migrator.migrate(before)
    old = migrator.loader.project_state(before).apps
    rollout = _rollout_then(old)
    kinds = {
        "requests": "requests",
        "embedder: requests": "requests",  # a lockstep member's
        "custom: requests": "custom",  # a custom metric may be named anything
        "p99": "latency",
        "latency (samples)": "latency",
        "error_ratio": "errors",
        "embedder: error_ratio (samples)": "errors",
        "mean latency reranker v2 vs v1": "step",
        "availability burn rate": "burn",
        "quality before traffic": "quality",
        "quality before the switch: retriever": "quality",
        "quality (evaluation)": "quality",
        "prometheus": "prometheus",
    }
    for metric in kinds:
        old.get_model("rollouts", "Measurement").objects.create(
            rollout=rollout, step=0, metric=metric, verdict="success"
        )
    MigrationExecutor(connection).migrate(after)
    found = Measurement.objects.filter(rollout_id=rollout.pk).values_list("metric", "kind")
    assert dict(found) == kinds


def _rollout_then(old: Any) -> Any:
    """A rollout as the rollouts' tables were at an earlier migration (`old`: its apps)."""
    return old.get_model("rollouts", "Rollout").objects.create(
        model_id=Model.objects.create(name="rag").pk,
        pool_id=NodePool.objects.create(name="gpu").pk,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
    )
