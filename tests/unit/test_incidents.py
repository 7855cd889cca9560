"""Incidents: Alertmanager's webhook opens, updates and resolves them; suspects are ranked with
their evidence; a suspect's rollback is audited under its incident; the page and the report."""

import re
from collections.abc import Callable
from datetime import datetime, timedelta
from html import unescape
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.accounts.services import token_create
from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.models import Deployment, NodePool, Release
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.incidents import suspects as suspects_module
from apps.incidents.models import Incident
from apps.incidents.services import incident_open, incident_rollback
from apps.incidents.suspects import Suspect, _score, suspects
from apps.prometheus.client import Series
from apps.registry.imports import repository_import
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start

pytestmark = pytest.mark.django_db
REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"
URLS = {"grpc_url": "127.0.0.1:8101", "metrics_url": "http://127.0.0.1:8102/metrics"}


def alert(status: str, starts: datetime, ends: datetime | None = None) -> dict:
    labels = {"alertname": "TritonP99OverBudget", "pool": "demo", "model": "rag_pipeline"}
    labels |= {"severity": "critical"}
    return {
        "version": "4",
        "groupKey": '{}:{alertname="TritonP99OverBudget"}',
        "status": status,
        "receiver": "controlplane",
        "groupLabels": {"alertname": "TritonP99OverBudget"},
        "commonLabels": labels,
        "commonAnnotations": {"summary": "P99 of rag_pipeline in pool demo is 412 ms"},
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": {},
                "startsAt": starts.isoformat(),
                "endsAt": (ends.isoformat() if ends else "0001-01-01T00:00:00Z"),
                "fingerprint": "abc",
            }
        ],
    }


@pytest.fixture
def fleet(db: None) -> NodePool:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    node_register(name="demo-1", pool="demo", http_url="http://127.0.0.1:1", actor="t", **URLS)
    return NodePool.objects.get(name="demo")


def test_alertmanager_opens_one_incident_per_alert_group_and_resolves_it(
    client: Client, operator: User, fleet: NodePool
) -> None:
    _, token = token_create(user=operator, name="alertmanager", actor="system:test")
    headers = {"Authorization": f"Bearer {token}"}

    def post(body: dict) -> dict:
        response = client.post(
            "/api/alertmanager", body, content_type="application/json", headers=headers
        )
        assert response.status_code == 200, response.content
        return response.json()

    onset = timezone.now() - timedelta(minutes=3)
    first = post(alert("firing", onset))
    again = post(alert("firing", onset))  # Alertmanager repeats until it is taken
    assert first["incident"] == again["incident"] and Incident.objects.count() == 1
    incident = Incident.objects.get()
    assert (incident.pool, incident.model) == (fleet, Model.objects.get(name="rag_pipeline"))
    assert incident.title == "P99 of rag_pipeline in pool demo is 412 ms"
    assert (incident.severity, incident.status, incident.started_at) == ("critical", "open", onset)
    ended = timezone.now() - timedelta(seconds=5)
    assert post(alert("resolved", onset, ended))["status"] == "resolved"
    incident.refresh_from_db()
    assert (incident.status, incident.ended_at) == ("resolved", ended)
    assert post(alert("resolved", onset, ended))["incident"] is None  # nothing open: no-op
    assert post(alert("firing", timezone.now()))["incident"] != incident.pk  # fires again: new
    actions = AuditEvent.objects.filter(target__startswith="incident:").order_by("id")
    assert list(actions.values_list("action", flat=True)) == [
        "incident.open",
        "incident.alert",
        "incident.resolve",
        "incident.open",
    ]


def test_a_payload_without_its_group_key_is_refused_with_the_field(
    client: Client, operator: User
) -> None:
    _, token = token_create(user=operator, name="alertmanager", actor="system:test")
    body = alert("firing", timezone.now()) | {"groupKey": ""}
    response = client.post(
        "/api/alertmanager",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 422 and "groupKey" in response.json()["error"]["message"]
    assert not Incident.objects.exists()


def at(moment: datetime, monkeypatch: pytest.MonkeyPatch, record: Callable[[], object]) -> None:
    """Something done at `moment` (the trail takes its time from the clock)."""
    with monkeypatch.context() as patched:
        patched.setattr(timezone, "now", lambda: moment)
        record()


def test_the_rollout_step_before_the_onset_is_ranked_first_on_its_evidence(
    fleet: NodePool, monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    onset = timezone.now() - timedelta(minutes=1)
    rag = Model.objects.get(name="rag_pipeline")
    rollout = Rollout.objects.create(
        model=rag,
        pool=fleet,
        baseline_version=1,
        canary_version=3,
        lockstep=[{"model": "embedder", "baseline": 1, "canary": 2}],
        plan=[],
        started_by="ann",
    )
    step = onset - timedelta(minutes=4)
    changes = [
        (onset - timedelta(minutes=30), "ops", "deployment.set", "pool:demo:rag_pipeline"),
        (step, "ann", "rollout.start", f"rollout:{rollout.pk}:rag_pipeline"),
        (step, "system:rollouts", "deployment.set", "node:demo-1:rag_pipeline"),
        (step, "system:rollouts", "deployment.set", "node:demo-1:embedder"),
        (step, "system:rollouts", "rollout.step", f"rollout:{rollout.pk}:rag_pipeline"),
        (onset - timedelta(minutes=2), "ops", "deployment.set", "pool:other:embedder"),
        (onset - timedelta(seconds=30), "bob", "version.create", "model:generator"),
    ]
    for moment, actor, action, target in changes:
        event = {"actor": actor, "action": action, "target": target}
        at(moment, monkeypatch, lambda event=event: audit_record(**event))
    queried: list[str] = []

    def range_query(query: str, *, start: datetime, end: datetime, step_s: int) -> list[Series]:
        """rag_pipeline: P99 40 ms and no errors, then 300 ms and 10% failing from the rollout's
        step on; others flat. No model here is an LLM: no first token."""
        queried.append(query)
        if "first_token" in query:
            return []
        times = [start.timestamp() + s for s in range(0, int((end - start).total_seconds()), 5)]
        worse = "rag_pipeline" in query
        normal, bad = (0.0, 0.1) if "failure" in query else (40.0, 300.0)
        values = [bad if worse and t >= step.timestamp() else normal for t in times]
        return [Series(labels={}, times=times, values=list(values))]

    monkeypatch.setattr(suspects_module, "range_query", range_query)
    incident = Incident.objects.create(
        title="slow", started_at=onset, opened_by="t", pool=fleet, model=rag
    )
    ranked, problem = suspects(incident)
    assert problem == ""
    first = ranked[0]
    assert (
        first.title == f"rollout #{rollout.pk}: rag_pipeline v1 → v3 with embedder v1 → v2 on demo"
    )
    # Its controller's deployments are folded into it, of the model released in lockstep too.
    assert "deployment.set node:demo-1:rag_pipeline" in first.parts
    assert "deployment.set node:demo-1:embedder" in first.parts
    assert first.p99 == (40.0, 300.0) and "P99 40 ms → 300 ms across it (x7.50)" in first.evidence
    assert (
        first.errors == (0.0, 0.1) and "errors 0.0% → 10.0% of requests across it" in first.evidence
    )
    assert first.rollback and (first.model, first.pool) == ("rag_pipeline", "demo")
    assert len(ranked) == 4 and ranked[-1].title == "deployment.set pool:other:embedder"
    assert len(queried) == 9  # three per model and pool (rag_pipeline's twice), not per change

    # Prometheus down: still ranked, by scope and time, and the page says why.
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    monkeypatch.undo()
    ranked, problem = suspects(incident)
    assert "did not answer" in problem and ranked[0].title.startswith(f"rollout #{rollout.pk}")


def test_an_llms_first_token_moving_across_a_change_ranks_it() -> None:
    """A release of the LLM step whose first token got 4x slower, its whole requests as before,
    outranks one that moved nothing, with the evidence said."""
    onset = timezone.now()
    slow, flat = (
        Suspect(onset - timedelta(minutes=5), "deployment.set", t, "generator", "demo", t)
        for t in ("slow", "flat")
    )
    slow.p99 = flat.p99 = (2300.0, 2300.0)
    slow.ttft, flat.ttft = (200.0, 800.0), (200.0, 200.0)
    for suspect in (slow, flat):
        _score(suspect, onset, "generator", "demo")
    assert slow.score == 3 * flat.score  # a doubling counts once more: twice
    assert "time to first token P99 200 ms → 800 ms across it (x4.00)" in slow.evidence


def test_a_suspects_rollback_is_recorded_under_its_incident(
    fleet: NodePool, operator: User
) -> None:
    for version in (1, 2):
        deployment_set(model_name="rag_pipeline", version=version, pool=fleet, actor="ops")
    incident = incident_open(
        title="slow", severity="critical", start=timezone.now(), actor=operator, pool="demo"
    )
    done = incident_rollback(
        incident_id=incident.pk, model="rag_pipeline", pool="demo", actor=operator
    )
    assert done == "pool demo is rolling rag_pipeline back to v1"
    assert Deployment.objects.get(pool=fleet).version == 1
    incident.refresh_from_db()
    assert incident.status == "mitigated" and incident.mitigated_at is not None
    event = AuditEvent.objects.get(action="incident.rollback")
    assert event.target == f"incident:{incident.pk}" and event.actor == operator.username
    assert {"release.rollback", "deployment.set"} <= {part["action"] for part in event.parts}


def test_a_rollout_suspect_is_rolled_back_by_on_call_to_the_release_it_started_from(
    fleet: NodePool, operator: User
) -> None:
    """On-call may roll a rollout back, not steer it: the pool's last good release would be
    the one before the rollout's baseline, or none ("no earlier good release")."""
    deployment_set(model_name="rag_pipeline", version=1, pool=fleet, actor="ops")
    rollout = rollout_start(
        model_name="rag_pipeline",
        pool_name="demo",
        canary_version=3,
        plan="1 node, hold 60s\n100%",
        analysis={},
        actor="release-manager",
    )
    incident = incident_open(title="slow", severity="critical", start=timezone.now(), actor="t")
    done = incident_rollback(
        incident_id=incident.pk,
        model="rag_pipeline",
        pool="demo",
        rollout=rollout.pk,
        actor=operator,
    )
    assert done == f"rollout #{rollout.pk} is rolling back to v1"
    assert Rollout.objects.get(pk=rollout.pk).state == Rollout.State.ABORTING
    assert Deployment.objects.get(pool=fleet).version == 1
    assert not Release.objects.filter(pool=fleet, rolled_back=True).exists()
    event = AuditEvent.objects.get(action="incident.rollback")
    assert "rollout.aborting" in {part["action"] for part in event.parts}


def test_the_incident_page_and_its_report_read_in_order(
    client: Client,
    operator: User,
    fleet: NodePool,
    settings: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(operator)
    start = timezone.now() - timedelta(minutes=10)
    deploy = {"model_name": "rag_pipeline", "version": 2, "pool": fleet, "actor": "ops"}
    at(start - timedelta(minutes=5), monkeypatch, lambda: deployment_set(**deploy))
    response = client.post(
        "/incidents/open/",
        {"title": "rag slow", "severity": "critical", "start": f"{start:%Y-%m-%dT%H:%M:%S}"},
    )
    incident = Incident.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/incidents/{incident.pk}/"
    client.post(
        f"/incidents/{incident.pk}/update/", {"status": "resolved", "owner": "", "notes": "fixed"}
    )
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "rag slow" in page and "Ranked without the series" in page
    assert (
        "deployment.set pool:demo:rag_pipeline" in page and "Roll back rag_pipeline on demo" in page
    )
    report = client.get(f"/incidents/{incident.pk}/report.md").content.decode()
    sections = [
        "# Incident #",
        "Time to detect",
        "## Notes",
        "## Suspect changes",
        "## What was done",
    ]
    assert [report.index(s) for s in sections] == sorted(report.index(s) for s in sections)
    assert "`incident.open`" in report and "`incident.update`" in report
    assert (
        "1. **deployment.set pool:demo:rag_pipeline**" in report
        and "5 min before the onset" in report
    )
    assert client.get("/incidents/").status_code == 200


def test_an_incident_needs_a_title_and_a_viewer_cannot_open_one(
    client: Client, viewer: User, operator: User
) -> None:
    client.force_login(operator)
    client.post("/incidents/open/", {"title": " ", "start": "2026-11-30T10:00"}, follow=True)
    assert not Incident.objects.exists()
    client.force_login(viewer)
    response = client.post("/incidents/open/", {"title": "x", "start": "2026-11-30T10:00"})
    assert response.status_code == 403 and not Incident.objects.exists()


def test_any_chart_leads_to_its_window_where_an_incident_opens(
    client: Client, operator: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    def range_query(query: str, *, start: datetime, end: datetime, step_s: int) -> list[Series]:
        return [Series({"model": "rag_pipeline", "version": "1"}, [start.timestamp()], [12.0])]

    monkeypatch.setattr("apps.observability.charts.range_query", range_query)
    client.force_login(operator)
    fragment = client.get(
        "/metrics/?metric=p99&range=1h&model=rag_pipeline", headers={"HX-Request": "true"}
    ).content.decode()
    link = re.search(r'href="(/audit/timeline/\?[^"]+)">What changed in this window', fragment)
    assert link and "model=rag_pipeline" in link[1]
    timeline = client.get(unescape(link[1])).content.decode()
    assert 'id="open-incident"' in timeline and 'name="model" value="rag_pipeline"' in timeline
