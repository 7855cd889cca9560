"""Data that lasts, and only as long as it should: old records pruned in batches, what the system
still reads kept; the audit trail kept forever, by month on PostgreSQL, archived a month at a
time, and out of reach of the application's own role."""

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from unittest import mock

import psycopg
import pytest
from axes.models import AccessAttempt, AccessFailureLog
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from apps.accounts.roles import Role
from apps.approvals.models import Approval
from apps.audit.models import AuditEvent
from apps.audit.partitions import audit_partitions, audit_partitions_ensure, partition_name
from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool, Operation
from apps.quality.models import CaseResult, EvaluationCase, EvaluationRun, EvaluationSet
from apps.registry.models import Model
from apps.retention.services import retention_prune
from apps.retention.tasks import prune
from apps.rollouts.models import Measurement, Notification, Rollout
from tests.support.users import make_user

postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="partitions and roles are PostgreSQL's"
)
OLD = timezone.now() - timedelta(days=120)
RECENT = timezone.now() - timedelta(days=10)


def _operation(node: Node, model: str, status: str, finished_at: datetime) -> Operation:
    return Operation.objects.create(
        node=node, kind="load", model_name=model, status=status, finished_at=finished_at
    )


def _rollout(model: Model, pool: NodePool, state: str) -> Rollout:
    rollout = Rollout.objects.create(
        model=model, pool=pool, baseline_version=1, canary_version=2, plan=[], state=state
    )
    for taken_at in (OLD, RECENT):
        measurement = Measurement.objects.create(
            rollout=rollout, step=0, kind="latency", metric="p99", query="q", verdict="success"
        )
        Measurement.objects.filter(pk=measurement.pk).update(taken_at=taken_at)
    return rollout


def _aged(model: type, field: str, when: datetime, **fields: object) -> object:
    row = model.objects.create(**fields)  # type: ignore[attr-defined]
    model.objects.filter(pk=row.pk).update(**{field: when})  # type: ignore[attr-defined]
    return row


@pytest.fixture
def seeded(db: None) -> dict[str, object]:
    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://127.0.0.1:1")
    day = timedelta(days=1)
    ops = {
        "old success": _operation(node, "m", "succeeded", OLD),
        "old failure": _operation(node, "m", "failed", OLD + day),
        "latest success": _operation(node, "m", "succeeded", OLD + 2 * day),
        "latest": _operation(node, "m", "failed", OLD + 3 * day),
        "only one": _operation(node, "solo", "succeeded", OLD),
        "recent": _operation(node, "solo", "cancelled", RECENT),
        "other node's": _operation(
            Node.objects.create(name="n2", pool=pool, http_url="http://127.0.0.1:2"),
            "m",
            "unknown",
            OLD,
        ),
    }
    # Older than the others but still queued: only finished operations go.
    ops["queued"] = Operation.objects.create(node=node, kind="load", model_name="m")
    for name, when in (("gone-long-ago", OLD), ("gone-lately", RECENT)):
        departed = Node.objects.create(
            name=name, pool=pool, http_url="http://127.0.0.1:3", stage=Node.Stage.DEPARTED
        )
        Node.objects.filter(pk=departed.pk).update(stage_changed_at=when)
        ops[f"{name}'s"] = _operation(departed, "m", "succeeded", OLD)
    model = Model.objects.create(name="rag")
    cases = EvaluationSet.objects.create(model=model, name="golden", version=1, created_by="x")
    case = EvaluationCase.objects.create(
        evaluation_set=cases, line=1, name="a", inputs={}, expect={}
    )
    runs = {}
    for name, finished_at in (("old", OLD), ("recent", RECENT), ("running", None)):
        runs[name] = EvaluationRun.objects.create(
            evaluation_set=cases, version=1, finished_at=finished_at, passed=1
        )
        CaseResult.objects.create(run=runs[name], case=case, version=1, passed=True)
    done = _rollout(model, pool, Rollout.State.SUCCEEDED)
    active = _rollout(Model.objects.create(name="emb"), pool, Rollout.State.PROGRESSING)
    user = make_user(Role.OPERATOR)
    notice = {"rollout": done, "event": "done", "payload": {}}
    approval = {"pool": pool, "action": "deployment.set", "params": {}, "requested_by": user}
    later = timezone.now() + timedelta(hours=1)
    return {
        "ops": ops,
        "runs": runs,
        "done": done,
        "active": active,
        "notifications": [
            _aged(Notification, "created_at", OLD, status="sent", **notice),
            _aged(Notification, "created_at", OLD, status="pending", **notice),
            _aged(Notification, "created_at", RECENT, status="failed", **notice),
        ],
        "approvals": [
            _aged(Approval, "requested_at", OLD, status="approved", expires_at=OLD, **approval),
            _aged(Approval, "requested_at", OLD, status="pending", expires_at=later, **approval),
            _aged(Approval, "requested_at", RECENT, status="failed", expires_at=later, **approval),
        ],
        "attempts": [
            _aged(AccessAttempt, "attempt_time", when, username=name, failures_since_start=1)
            for name, when in (("old", OLD), ("recent", RECENT))
        ],
        "failures": [_aged(AccessFailureLog, "attempt_time", OLD, username="old")],
        "sessions": [
            Session.objects.create(session_key=key, session_data="", expire_date=when)
            for key, when in (("gone", RECENT), ("live", later))
        ],
        "trail": [audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")],
    }


def test_old_records_are_pruned_in_batches_and_those_still_read_are_kept(
    seeded: dict, settings: object
) -> None:
    settings.RETENTION_BATCH = 1  # type: ignore[attr-defined]
    counts = retention_prune(actor="system:test")

    ops = seeded["ops"]
    kept = set(Operation.objects.values_list("pk", flat=True))
    gone = ("old success", "old failure", "gone-long-ago's")  # a departed node's go with it
    assert kept == {ops[name].pk for name in ops if name not in gone}
    assert set(seeded["done"].measurements.values_list("taken_at", flat=True)) == {RECENT}
    assert seeded["active"].measurements.count() == 2  # a rollout under way keeps all
    _, pending, recent = seeded["notifications"]
    assert set(Notification.objects.values_list("pk", flat=True)) == {pending.pk, recent.pk}
    _, waiting, settled = seeded["approvals"]
    assert set(Approval.objects.values_list("pk", flat=True)) == {waiting.pk, settled.pk}
    assert list(AccessAttempt.objects.values_list("username", flat=True)) == ["recent"]
    assert not AccessFailureLog.objects.exists()
    assert list(Session.objects.values_list("session_key", flat=True)) == ["live"]
    assert AuditEvent.objects.filter(pk=seeded["trail"][0].pk).exists()
    runs = seeded["runs"]
    answered = CaseResult.objects.values_list("run_id", flat=True)
    assert set(answered) == {runs["recent"].pk, runs["running"].pk}
    assert EvaluationRun.objects.get(pk=runs["old"].pk).passed == 1  # the run keeps its counts

    assert not Node.objects.filter(name="gone-long-ago").exists()
    assert Node.objects.filter(name="gone-lately").exists()
    expected = {"departed": 1, "operations": 2, "measurements": 1, "notifications": 1}
    expected |= {"approvals": 1, "answers": 1}
    assert counts | expected == counts
    assert (counts["logins"], counts["sessions"]) == (2, 1)
    event = AuditEvent.objects.get(action="retention.prune")
    assert (event.actor, event.target, event.after) == ("system:test", "database", counts)
    assert set(retention_prune(actor="system:test").values()) == {0}  # nothing left to do


def test_a_kind_kept_for_zero_days_is_never_pruned(seeded: dict, settings: object) -> None:
    kept = {"operations": 0, "departed": 0}
    settings.RETENTION_DAYS_BY_KIND = {**settings.RETENTION_DAYS_BY_KIND, **kept}  # type: ignore[attr-defined]
    counts = retention_prune(actor="system:test")
    assert counts["operations"] == counts["departed"] == 0
    assert Operation.objects.count() == len(seeded["ops"])
    assert counts["notifications"] == 1


def test_beat_runs_the_prune_task_and_the_command_the_same_service(
    seeded: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    assert settings.CELERY_BEAT_SCHEDULE["retention"]["task"] == prune.name == "retention.prune"
    prune()
    assert AuditEvent.objects.get(action="retention.prune").actor == "system:retention"
    assert not Notification.objects.filter(pk=seeded["notifications"][0].pk).exists()
    call_command("prune")
    assert "operations 0, measurements 0" in capsys.readouterr().out
    assert AuditEvent.objects.filter(action="retention.prune", actor="system:prune").count() == 1


def test_the_database_refuses_to_change_or_delete_an_event_on_either_database(db: None) -> None:
    event = audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(pk=event.pk).update(actor="someone else")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(pk=event.pk).delete()
    assert AuditEvent.objects.get(pk=event.pk).actor == "ops"


@pytest.mark.django_db(transaction=True)
def test_flush_empties_the_trail_and_leaves_it_append_only() -> None:
    audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")
    call_command("flush", interactive=False, verbosity=0)
    assert not AuditEvent.objects.exists()
    event = audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(pk=event.pk).delete()


# PostgreSQL: partitions by month, archives, roles ----------------------------------------------


def _month(months_from_now: int) -> date:
    month = timezone.now().date().replace(day=1)
    for _ in range(abs(months_from_now)):
        month = (month + timedelta(days=32 if months_from_now > 0 else -1)).replace(day=1)
    return month


def _start(month: date) -> datetime:
    return datetime(month.year, month.month, 1, tzinfo=UTC)


def _events_in(month: date, count: int) -> list[AuditEvent]:
    """Events written as if during `month`, in a partition of its own."""
    after = (month + timedelta(days=32)).replace(day=1)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {partition_name(month)} PARTITION OF audit_auditevent "
            "FOR VALUES FROM (%s) TO (%s)",
            [_start(month), _start(after)],
        )
    with mock.patch("django.utils.timezone.now", return_value=_start(month) + timedelta(days=2)):
        events = [  # auto_now_add reads the clock
            audit_record(actor="ops", action="node.drain", target=f"node:n{i}", after={"i": i})
            for i in range(count)
        ]
    with connection.cursor() as cursor:
        # Written months before their archive, outside a test, their deferred foreign key
        # checks are long done: a partition with checks pending cannot be dropped.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    return events


@postgresql_only
def test_the_coming_months_have_partitions_and_a_default_takes_any_other(db: None) -> None:
    audit_partitions_ensure()
    names = audit_partitions()
    assert {partition_name(_month(ahead)) for ahead in range(4)} <= set(names)
    assert names[-1] == "audit_auditevent_default"
    far = timezone.now() + timedelta(days=3650)
    with mock.patch("django.utils.timezone.now", return_value=far):
        event = audit_record(actor="ops", action="node.drain", target="node:n1")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text FROM audit_auditevent WHERE id = %s", [event.pk]
        )
        assert cursor.fetchone()[0] == "audit_auditevent_default"


@postgresql_only
def test_a_past_month_is_archived_to_json_lines_and_its_partition_detached(
    db: None, tmp_path: Path
) -> None:
    month = _month(-10)
    events = _events_in(month, 3)
    recent = audit_record(actor="ops", action="deployment.set", target="pool:gpu:rag")
    out = tmp_path / "audit.jsonl"

    call_command("audit_archive", "--month", f"{month:%Y-%m}", "--out", str(out))

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["actor"], r["action"], r["target"], r["after"]) for r in rows] == [
        (e.pk, "ops", "node.drain", f"node:n{i}", {"i": i}) for i, e in enumerate(events)
    ]
    assert rows[0]["created_at"].startswith(f"{month:%Y-%m}-03T00:00:00")
    assert partition_name(month) not in audit_partitions()
    with connection.cursor() as cursor:  # detached, not dropped
        cursor.execute(f"SELECT count(*) FROM {partition_name(month)}")  # noqa: S608
        assert cursor.fetchone()[0] == 3
    assert set(AuditEvent.objects.values_list("pk", flat=True)) >= {recent.pk}
    assert not AuditEvent.objects.filter(pk__in=[e.pk for e in events]).exists()
    archive = AuditEvent.objects.get(action="audit.archive")
    assert archive.after == {
        "events": 3,
        "file": str(out),
        "partition": partition_name(month),
        "dropped": False,
    }

    with pytest.raises(CommandError, match="not over yet"):
        call_command("audit_archive", "--month", f"{_month(0):%Y-%m}", "--out", str(tmp_path / "x"))
    with pytest.raises(CommandError, match="no attached partition"):
        call_command("audit_archive", "--month", f"{month:%Y-%m}", "--out", str(tmp_path / "y"))


@postgresql_only
def test_an_archived_month_can_be_dropped_once_written(db: None, tmp_path: Path) -> None:
    month = _month(-11)
    _events_in(month, 2)
    out = tmp_path / "audit.jsonl"
    call_command("audit_archive", "--month", f"{month:%Y-%m}", "--out", str(out), "--drop")
    assert len(out.read_text().splitlines()) == 2
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [partition_name(month)])
        assert cursor.fetchone()[0] is None


@pytest.fixture
def app_role(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[psycopg.Connection]:
    """A role made and granted as deploy/README.md says, and a connection of its own."""
    role = f"controlplane_app_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TEST_APP_ROLE_PASSWORD", "app-role-password")
    call_command("grant_app_role", "--role", role, "--password-env", "TEST_APP_ROLE_PASSWORD")
    db = connection.settings_dict
    try:
        with psycopg.connect(
            host=db["HOST"] or "127.0.0.1",
            port=db["PORT"] or 5432,
            dbname=db["NAME"],
            user=role,
            password="app-role-password",
            autocommit=True,
        ) as app:
            yield app
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP OWNED BY "{role}"')
            cursor.execute(f'DROP ROLE "{role}"')


@postgresql_only
def test_the_application_role_appends_to_the_trail_but_never_rewrites_it(
    app_role: psycopg.Connection, admin_user: User
) -> None:
    before = AuditEvent.objects.count()
    insert = (
        "INSERT INTO audit_auditevent (created_at, actor, action, target, before, after, result, "
        "message, request_id, via) VALUES (now(), 'app', 'node.drain', 'node:n1', '{}', '{}', "
        "'ok', '', '', '') RETURNING id"
    )
    app_role.execute(insert)
    assert app_role.execute("SELECT count(*) FROM audit_auditevent").fetchone() == (before + 1,)
    app_role.execute("SELECT audit_partitions_ensure(3)")
    for statement in (
        "UPDATE audit_auditevent SET actor = 'someone else'",
        "DELETE FROM audit_auditevent",
        "TRUNCATE audit_auditevent",
        f"DELETE FROM {partition_name(_month(0))}",  # noqa: S608
        f"TRUNCATE {partition_name(_month(0))}",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            app_role.execute(statement)
    # Everything else: full DML.
    app_role.execute(
        "INSERT INTO django_session (session_key, session_data, expire_date) "
        "VALUES ('k', '', now())"
    )
    app_role.execute("UPDATE auth_user SET first_name = 'A' WHERE id = %s", [admin_user.pk])
    app_role.execute("DELETE FROM django_session")
    assert AuditEvent.objects.count() == before + 1
