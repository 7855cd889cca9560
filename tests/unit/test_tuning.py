"""Tuning as a release (apps/rollouts/tuning.py): an accepted advice becomes a step version that
differs only in the advised fields, a pipeline version pinning it, files for both in the nodes'
repository, and a rollout judged on throughput and queue time; refused, it leaves nothing."""

import shutil
from html import unescape
from pathlib import Path

import pytest
from django.test import Client

from apps.accounts.permissions import ApprovalRequired
from apps.accounts.roles import Role
from apps.approvals.services import approval_approve, approval_request
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.pools import pool_role_set
from apps.observability import bottleneck as pipeline
from apps.observability.bottleneck import Advice, Bottleneck, Gpus
from apps.registry.codec import parse_pbtxt, to_dict, tuned
from apps.registry.imports import repository_import
from apps.registry.models import ModelVersion
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import RolloutError
from apps.rollouts.tuning import tuning_start
from tests.support import REPOSITORY
from tests.support.users import make_user

pytestmark = pytest.mark.django_db

ADVICE = Advice(
    "reranker",
    "more instances: 1 -> 2",
    "requests wait 40.0 ms for 10.0 ms of compute",
    "queue time should fall",
    {"instance_group": [{"count": 2}]},
)
PLAN = "1 node, hold 60s\n100%"


def test_advised_fields_are_laid_over_the_config_and_nothing_else_changes() -> None:
    config = {
        "name": "reranker",
        "instance_group": [{"kind": "KIND_CPU", "count": 1}, {"kind": "KIND_GPU", "count": 3}],
        "dynamic_batching": {"max_queue_delay_microseconds": "2000", "preferred_batch_size": [4]},
    }
    assert tuned(config, {"instance_group": [{"count": 2}]}) == config | {
        "instance_group": [{"kind": "KIND_CPU", "count": 2}, {"kind": "KIND_GPU", "count": 3}]
    }
    assert tuned(config, {"dynamic_batching": {"max_queue_delay_microseconds": "500"}})[
        "dynamic_batching"
    ] == {"max_queue_delay_microseconds": "500", "preferred_batch_size": [4]}
    assert tuned({"name": "x"}, {"instance_group": [{"count": 2}]}) == {
        "name": "x",
        "instance_group": [{"count": 2}],
    }
    assert config["instance_group"][0]["count"] == 1  # the source is left as it was


@pytest.fixture
def models(tmp_path: Path, settings: object) -> Path:
    """The demo repository copied, imported with its files, every version published, and pool
    gpu's two nodes serving rag_pipeline v1."""
    root = tmp_path / "deploy"
    shutil.copytree(REPOSITORY, root / "models", ignore=shutil.ignore_patterns("__pycache__"))
    settings.REGISTRY_ARTIFACT_ROOTS = [str(root / "models")]  # type: ignore[attr-defined]
    assert all(r.ok for r in repository_import(path=root / "models", actor="system:test"))
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2"):
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="ops")
    return root / "models"


def versions() -> set[tuple[str, int]]:
    return set(ModelVersion.objects.values_list("model__name", "version"))


def test_an_accepted_advice_is_a_step_version_a_pipeline_pinning_it_and_their_rollout(
    models: Path,
) -> None:
    rollout = tuning_start(
        pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops"
    )
    source = ModelVersion.objects.get(model__name="reranker", version=1)
    step = ModelVersion.objects.get(model__name="reranker", version=7)
    # The same config but for the advised field; a draft, so that no pin to the latest takes it.
    assert step.config["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert {k: v for k, v in step.config.items() if k != "instance_group"} == {
        k: v for k, v in source.config.items() if k != "instance_group"
    }
    assert step.status == ModelVersion.Status.DRAFT
    assert "Tuning of v1: more instances: 1 -> 2, advised because requests wait" in step.notes
    baseline = ModelVersion.objects.get(model__name="rag_pipeline", version=1)
    canary = ModelVersion.objects.get(model__name="rag_pipeline", version=15)
    pins = {
        s["model_name"]: s["model_version"] for s in canary.config["ensemble_scheduling"]["step"]
    }
    was = {
        s["model_name"]: s["model_version"] for s in baseline.config["ensemble_scheduling"]["step"]
    }
    assert pins == was | {"reranker": "7"}
    # Files Triton can load: the source's, with the registry's config beside them.
    assert (models / "reranker" / "7" / "model.py").read_text() == (
        models / "reranker" / "1" / "model.py"
    ).read_text()
    written = parse_pbtxt((models / "reranker" / "7" / "config.pbtxt").read_text())
    assert to_dict(written) == step.config
    assert step.artifact == str(models / "reranker" / "7")
    assert (models / "rag_pipeline" / "15" / "config.pbtxt").is_file()
    assert (rollout.model.name, rollout.baseline_version, rollout.canary_version) == (
        "rag_pipeline",
        1,
        15,
    )
    judged = {m["name"]: m for m in rollout.analysis["metrics"]}
    throughput = judged["rag_pipeline requests/s a node"]
    assert throughput["higher_is_better"] and 'model="rag_pipeline"' in throughput["query"]
    queue = judged["reranker queue (ms a request)"]
    assert not queue["higher_is_better"] and "nv_inference_queue_duration_us" in queue["query"]
    assert all('node=~"$nodes"' in m["query"] for m in judged.values())
    event = AuditEvent.objects.get(action="rollout.tune")
    assert (event.result, event.target) == ("ok", f"rollout:{rollout.pk}:rag_pipeline")
    assert event.after["because"] == ADVICE.because
    assert event.after["fields"] == {"instance_group": [{"count": 2}]}
    assert event.after["pipeline"] == {"from": 1, "to": 15}


def test_the_rollout_page_says_what_the_tuning_changed_and_why(
    models: Path, client: Client
) -> None:
    rollout = tuning_start(
        pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops"
    )
    client.force_login(make_user(Role.VIEWER))
    body = unescape(client.get(f"/rollouts/{rollout.pk}/").content.decode())
    card = body.split('id="tuning"')[1].split("</section>")[0]
    assert "Tuning: reranker v1 → v7, more instances: 1 -> 2</h2>" in card
    assert f"Advised because {ADVICE.because}. Expected: {ADVICE.expect}." in card
    assert "v15 is v1 with reranker v7, whose config differs only in instance_group." in card
    assert 'href="/metrics/bottleneck/rag_pipeline/?pool=gpu"' in card
    assert "/metrics/?metric=cost&model=reranker&pool=gpu&range=custom&start=" in card
    # Any other rollout has no such card.
    rollout.delete()
    other = Rollout.objects.create(
        model=rollout.model,
        pool=rollout.pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
    )
    assert 'id="tuning"' not in client.get(f"/rollouts/{other.pk}/").content.decode()


def test_a_refused_rollout_leaves_no_version_and_no_file(models: Path) -> None:
    tuning_start(pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops")
    before = versions()
    with pytest.raises(RolloutError, match="is pending"):
        tuning_start(
            pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops"
        )
    assert versions() == before
    assert not (models / "reranker" / "8").exists()
    assert not (models / "rag_pipeline" / "16").exists()
    refused = AuditEvent.objects.filter(action="rollout.tune").latest("id")
    assert refused.result == "failed"


def test_files_it_may_not_write_are_refused_before_anything_is_made(
    models: Path, settings: object
) -> None:
    settings.REGISTRY_ARTIFACT_ROOTS = [str(models / "embedder")]  # type: ignore[attr-defined]
    before = versions()
    with pytest.raises(
        RolloutError, match=r"reranker v1's files are at .* REGISTRY_ARTIFACT_ROOTS"
    ):
        tuning_start(
            pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops"
        )
    assert versions() == before and not (models / "reranker" / "7").exists()


def test_a_version_directory_appears_whole_or_not_at_all(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied aside under a hidden name, then renamed: a request killed while it copies never
    leaves half a version where Triton reads versions."""
    from apps.rollouts import tuning

    copying: list[str] = []
    copy = shutil.copytree

    def watched(source: Path, target: Path, **options: object) -> object:
        number = target.name.split(".")[1]
        copying.append(f"{target.parent.name}/{target.name.split('-')[0]}")
        assert not (target.parent / number).exists()  # the version, while it is copied
        return copy(source, target, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(tuning.shutil, "copytree", watched)
    tuning_start(pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops")
    assert copying == ["reranker/.7.partial", "rag_pipeline/.15.partial"]
    assert (models / "reranker" / "7" / "config.pbtxt").exists()
    assert not list((models / "reranker").glob(".*"))


def test_files_holding_a_link_are_refused_before_anything_is_copied(models: Path) -> None:
    link = models / "reranker" / "1" / "weights"
    link.symlink_to("/etc/hostname")
    before = versions()
    with pytest.raises(RolloutError, match=r"reranker v1's files hold a symbolic link, .*weights"):
        tuning_start(
            pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor="ops"
        )
    assert versions() == before and not (models / "reranker" / "7").exists()


def test_an_advice_that_changes_no_field_and_an_unknown_step_are_refused(models: Path) -> None:
    nodes = Advice("reranker", "more nodes, not instances", "GPUs 95% busy", "less queue")
    with pytest.raises(RolloutError, match="changes no config field"):
        tuning_start(pipeline="rag_pipeline", pool_name="gpu", advice=nodes, plan=PLAN, actor="ops")
    other = Advice("nope", ADVICE.change, ADVICE.because, ADVICE.expect, ADVICE.fields)
    with pytest.raises(RolloutError, match="rag_pipeline v1 has no step nope"):
        tuning_start(pipeline="rag_pipeline", pool_name="gpu", advice=other, plan=PLAN, actor="ops")


def test_on_a_protected_pool_the_whole_tuning_waits_for_a_second_person(models: Path) -> None:
    NodePool.objects.filter(name="gpu").update(protected=True)
    asking = make_user(Role.RELEASE_MANAGER)
    before = versions()
    with pytest.raises(ApprovalRequired) as refused:
        tuning_start(
            pipeline="rag_pipeline", pool_name="gpu", advice=ADVICE, plan=PLAN, actor=asking
        )
    assert versions() == before  # nothing is made until someone approves
    approval = approval_request(refused=refused.value, actor=asking)
    approval_approve(approval_id=approval.pk, actor=make_user(Role.ADMIN))
    rollout = Rollout.objects.get()
    assert (rollout.canary_version, rollout.started_by) == (15, asking.username)
    assert ("reranker", 7) in versions()


def stubbed(advice: list[Advice]) -> Bottleneck:
    return Bottleneck(
        steps=[], gpus=Gpus(None, None, None, None), slowest=None, waiting="", advice=advice
    )


def test_the_page_reads_the_advice_again_before_it_releases_it(
    models: Path, monkeypatch: pytest.MonkeyPatch, client: Client
) -> None:
    client.force_login(make_user(Role.RELEASE_MANAGER))
    form = {"pool": "gpu", "step": "reranker", "change": ADVICE.change, "plan": PLAN}
    monkeypatch.setattr(pipeline, "bottleneck", lambda steps, pool: stubbed([]))
    stale = client.post("/rollouts/tune/rag_pipeline/", form, headers={"HX-Request": "true"})
    assert stale.status_code == 409
    assert "no longer holds" in stale.content.decode()
    assert not Rollout.objects.exists()
    monkeypatch.setattr(pipeline, "bottleneck", lambda steps, pool: stubbed([ADVICE]))
    response = client.post("/rollouts/tune/rag_pipeline/", form)
    rollout = Rollout.objects.get()
    assert response.status_code == 302 and response.url == f"/rollouts/{rollout.pk}/"
    assert rollout.plan == [{"nodes": 1, "hold_s": 60}, {"percent": 100, "hold_s": 0}]


def test_who_may_not_start_a_rollout_on_the_pool_is_refused_and_recorded(
    models: Path, client: Client
) -> None:
    user = make_user(Role.VIEWER)
    other = NodePool.objects.create(name="cpu")
    pool_role_set(username=user.username, pool_name=other.name, role="release_manager", actor="ops")
    client.force_login(user)
    form = {"pool": "gpu", "step": "reranker", "change": ADVICE.change}
    assert client.post("/rollouts/tune/rag_pipeline/", form).status_code == 403
    event = AuditEvent.objects.filter(action="rollout.tune").latest("id")
    assert (event.result, event.target) == ("denied", "pool:gpu")
    assert not Rollout.objects.exists()
