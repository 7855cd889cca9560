"""Each pool's desired state as files: export then apply on an empty database reproduces it
exactly; a diff names every difference; apply goes through the services a person uses (a
protected pool's change waits for a second person), as one audited change naming the commit,
all or nothing; a bad file names its line and changes nothing."""

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from apps.accounts.roles import Role
from apps.approvals.models import Approval
from apps.audit.models import AuditEvent
from apps.degradation.services import tiers_set
from apps.fleet.models import Deployment, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.scaling.models import Scaling
from apps.statefiles.files import FilesError
from apps.statefiles.services import desired_apply, plan
from tests.support.registry import import_demo
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def pools(db: None) -> list[NodePool]:
    """demo: rag_pipeline v1 with tiers v1 > v4, a queue, a short rollback window, bounds,
    open to discovery; gpu: protected, the embedder v1; empty: nothing set."""
    import_demo()
    demo = NodePool.objects.create(
        name="demo", queue="eu-west", rollback_window_s=600, discoverable=True, min_serving=2
    )
    gpu = NodePool.objects.create(name="gpu", protected=True)
    NodePool.objects.create(name="empty")
    deployment_set(model_name="rag_pipeline", version=1, pool=demo, actor="system:test")
    tiers_set(pool_name="demo", model_name="rag_pipeline", versions=[1, 4], actor="system:test")
    deployment_set(model_name="embedder", version=1, pool=gpu, actor="system:test")
    Scaling.objects.create(pool=demo, least=2, most=12)
    return [demo, gpu]


def export(folder: Path) -> dict[str, str]:
    call_command("desired", "export", "--dir", str(folder))
    return {path.name: path.read_text() for path in sorted(folder.glob("*.yaml"))}


def test_export_then_apply_on_an_empty_database_reproduces_the_desired_state(
    pools: list[NodePool], tmp_path: Path
) -> None:
    before = export(tmp_path / "a")
    assert set(before) == {"demo.yaml", "empty.yaml", "gpu.yaml"}
    assert before["demo.yaml"].splitlines()[2:] == [
        "pool: demo",
        "protected: false",
        "discoverable: true",
        "queue: eu-west",
        "rollback_window_s: 600",
        "traffic: {strategy: none, min_serving: 2, warmup_requests: 5, drain_timeout_s: 30}",
        "scaling: {least: 2, most: 12}",
        "deployments:",
        "- {model: rag_pipeline, version: 1, standby: 4}",  # the tier below stands by
        "tiers:",
        "  rag_pipeline: [1, 4]",
    ]
    assert export(tmp_path / "again") == before  # stable: a review shows changes only

    NodePool.objects.all().delete()
    files = {name: text for name, text in before.items()}
    applied = desired_apply(files=files, commit="3f2a9c1", actor="system:ci")
    assert applied.waiting == []
    assert "pool demo: new" in applied.changes
    assert export(tmp_path / "b") == before
    assert plan(files).differences() == []
    event = AuditEvent.objects.get(action="desired.apply")
    assert (event.target, event.after["commit"]) == ("desired:3f2a9c1", "3f2a9c1")
    assert len(event.after["parts"]) >= 8  # every service's change, parts of this one


def test_a_diff_names_every_difference(pools: list[NodePool], tmp_path: Path) -> None:
    files = export(tmp_path)
    files["demo.yaml"] = (
        files["demo.yaml"]
        .replace("queue: eu-west", "queue: us-east")
        .replace("least: 2, most: 12", "least: 3, most: 12")
        .replace("version: 1, standby: 4", "version: 4")
        .replace("rag_pipeline: [1, 4]", "rag_pipeline: [4, 5]")
    )
    del files["empty.yaml"]
    files["new.yaml"] = "pool: new\nrollback_window_s: 0\n"
    assert plan(files).differences() == [
        "pool demo: queue 'eu-west' -> 'us-east'",
        "pool demo: scaling {least: 2, most: 12} -> {least: 3, most: 12}",
        "pool demo: deployment of rag_pipeline v1 (v4 standing by) -> v4",
        "pool demo: tiers of rag_pipeline [1, 4] -> [4, 5]",
        "pool new: new",
        "pool new: rollback_window_s 900 -> 0",
        "pool empty: in no file (apply leaves it)",
    ]
    untiered = export(tmp_path)
    untiered["demo.yaml"] = untiered["demo.yaml"].split("tiers:")[0]  # left out
    assert plan(untiered).differences() == [
        "pool demo: tiers of rag_pipeline [1, 4] -> none"
        " (apply leaves them: nothing removes a pool's tiers)"
    ]
    out = tmp_path / "out.txt"
    with out.open("w") as written:
        call_command("desired", "diff", "--dir", str(tmp_path), stdout=written)
    assert out.read_text() == "no differences\n"


def test_apply_on_a_protected_pool_asks_a_second_person_and_applies_the_rest(
    pools: list[NodePool], tmp_path: Path
) -> None:
    files = export(tmp_path)
    files["gpu.yaml"] = files["gpu.yaml"].replace(
        "{model: embedder, version: 1}", "{model: embedder, version: 2}"
    )
    files["demo.yaml"] = files["demo.yaml"].replace("queue: eu-west", "queue: us-east")
    manager = make_user(Role.ADMIN)
    applied = desired_apply(files=files, commit="abc123", actor=manager)
    [approval] = Approval.objects.filter(status=Approval.Status.PENDING)
    assert applied.waiting == [approval.pk]
    assert (approval.action, approval.params["version"]) == ("deployment.set", 2)
    assert Deployment.objects.get(pool__name="gpu").version == 1  # waits
    assert NodePool.objects.get(name="demo").queue == "us-east"  # applied


def test_a_refusal_changes_nothing_and_names_the_line(
    pools: list[NodePool], tmp_path: Path
) -> None:
    files = export(tmp_path)
    files["demo.yaml"] = files["demo.yaml"].replace("queue: eu-west", "queue: us-east")
    # The embedder is no pipeline: deployment_set refuses it a standby.
    files["gpu.yaml"] = files["gpu.yaml"].replace("version: 1}", "version: 1, standby: 2}")
    last = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first()
    with pytest.raises(FilesError) as refused:
        desired_apply(files=files, commit="abc123", actor="system:ci")
    [problem] = refused.value.problems
    line = files["gpu.yaml"].splitlines().index("- {model: embedder, version: 1, standby: 2}") + 1
    assert (problem.file, problem.line, problem.field) == ("gpu.yaml", line, "deployments.0")
    assert problem.message == "embedder is not a pipeline: only a pipeline's steps stand by"
    assert NodePool.objects.get(name="demo").queue == "eu-west"  # all or nothing
    failed = AuditEvent.objects.get(pk__gt=last)
    assert (failed.action, failed.result) == ("desired.apply", "failed")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("pool: demo\nqueue: [unclosed\n", "demo.yaml:3: not YAML: expected ',' or ']'"),
        ("pool: demo\nprotected: maybe\n", "demo.yaml:2: protected: true or false, not 'maybe'"),
        ("pool: demo\n\nscaling:\n  least: -1\n", "demo.yaml:4: scaling.least: a whole number"),
        (
            "pool: demo\ndeployments:\n  - {model: rag_pipeline, version: 99}\n",
            "demo.yaml:3: deployments.0.version: rag_pipeline v99 is not in the registry",
        ),
        ("pool: other\n", "demo.yaml:1: pool: pool other is written in demo.yaml"),
        ("pool: demo\nreplicas: 3\n", "demo.yaml:2: replicas: not a setting of a pool"),
    ],
)
def test_a_bad_file_names_its_line_and_changes_nothing(
    pools: list[NodePool], text: str, where: str
) -> None:
    events = AuditEvent.objects.count()
    with pytest.raises(FilesError) as refused:
        desired_apply(files={"demo.yaml": text}, commit="abc123", actor="system:ci")
    assert str(refused.value.problems[0]).startswith(where)
    assert NodePool.objects.get(name="demo").queue == "eu-west"
    assert AuditEvent.objects.count() == events + 1  # the failure, on the trail


def test_the_command_dry_runs_unless_told_and_needs_a_commit(
    pools: list[NodePool], tmp_path: Path
) -> None:
    export(tmp_path)
    path = tmp_path / "demo.yaml"
    path.write_text(path.read_text().replace("queue: eu-west", "queue: us-east"))
    out = tmp_path / "out.txt"
    with out.open("w") as written:
        call_command("desired", "apply", "--dir", str(tmp_path), stdout=written)
    assert out.read_text().splitlines() == [
        "pool demo: queue 'eu-west' -> 'us-east'",
        "a dry run: --yes applies it",
    ]
    assert NodePool.objects.get(name="demo").queue == "eu-west"
    with pytest.raises(CommandError, match="commit: name the files' commit"):
        call_command("desired", "apply", "--dir", str(tmp_path), "--yes")
    call_command("desired", "apply", "--dir", str(tmp_path), "--yes", "--commit", "9e1f")
    assert NodePool.objects.get(name="demo").queue == "us-east"


def test_ci_diffs_and_applies_through_the_api(
    pools: list[NodePool], tmp_path: Path, client: Client
) -> None:
    files = export(tmp_path)
    files["demo.yaml"] = files["demo.yaml"].replace("queue: eu-west", "queue: us-east")
    headers = bearer(make_user(Role.ADMIN))
    diff = client.post(
        "/api/desired/validate", {"files": files}, content_type="application/json", headers=headers
    )
    assert diff.json() == {"differences": ["pool demo: queue 'eu-west' -> 'us-east'"]}
    bad = client.post(
        "/api/desired/apply",
        {"files": {"demo.yaml": "pool: demo\nqueue: 3\n"}, "commit": "abc"},
        content_type="application/json",
        headers=headers,
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["details"] == [
        {"file": "demo.yaml", "line": 2, "field": "queue", "message": "text, not 3"}
    ]
    applied = client.post(
        "/api/desired/apply",
        {"files": files, "commit": "abc"},
        content_type="application/json",
        headers=headers,
    )
    assert applied.status_code == 200
    assert applied.json() == {"changes": ["pool demo: queue 'eu-west' -> 'us-east'"], "waiting": []}
    assert NodePool.objects.get(name="demo").queue == "us-east"
