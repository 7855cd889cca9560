import io
import json
import random
import re
import shutil
import stat
import zipfile
from html import unescape
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client

from apps.audit.models import AuditEvent
from apps.registry import archives
from apps.registry.archives import ArchiveError, extract_repository
from apps.registry.codec import parse_pbtxt, to_pbtxt
from apps.registry.imports import read_candidates, repository_import
from apps.registry.models import Model, ModelVersion
from apps.registry.services import (
    RegistryError,
    compatibility_breaks,
    version_create,
    version_set_status,
)
from tests.support import REPOSITORY
from tests.support.ensemble_cases import (
    REPOSITORY_CASES,
    STEPS,
    Case,
    repository_configs,
    step,
    write_repository,
)
from tests.support.registry import import_demo

pytestmark = pytest.mark.django_db


def test_import_repository_json_says_ok_for_every_demo_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    call_command("import_repository", str(REPOSITORY), "--json")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["model"], line["ok"]) for line in lines] == [
        ("embedder", True),
        ("generator", True),
        ("llm", True),
        ("rag_pipeline", True),
        ("reranker", True),
        ("retriever", True),
    ]
    assert ModelVersion.objects.count() == 33
    assert Model.objects.get(name="rag_pipeline").kind == Model.Kind.ENSEMBLE
    v4 = ModelVersion.objects.get(model__name="rag_pipeline", version=4)
    assert v4.status == "published" and v4.artifact.endswith("deploy/models/rag_pipeline/4")
    assert ModelVersion.objects.get(model__name="reranker", version=3).checksum.startswith(
        "sha256:"
    )


def test_importing_twice_changes_nothing() -> None:
    import_demo()
    events = AuditEvent.objects.count()
    import_demo()
    assert ModelVersion.objects.count() == 33 and AuditEvent.objects.count() == events


def test_dry_run_stores_nothing() -> None:
    results = repository_import(path=REPOSITORY, actor="system:test", dry_run=True)
    assert all(r.ok for r in results) and ModelVersion.objects.count() == 0


def test_an_invalid_model_fails_the_import_and_the_ensembles_that_need_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "models"
    shutil.copytree(REPOSITORY, repository)
    config = repository / "reranker" / "config.pbtxt"
    config.write_text(config.read_text().replace("TYPE_FP32", "TYPE_FLOAT"))
    with pytest.raises(CommandError, match="2 invalid model"):
        call_command("import_repository", str(repository), "--json")
    lines = {line["model"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert lines["reranker"]["errors"][0].startswith(f"{config}:")
    assert "TYPE_FLOAT" in lines["reranker"]["errors"][0]
    assert not lines["rag_pipeline"]["ok"]
    assert "model 'reranker' is not in the registry" in lines["rag_pipeline"]["errors"][0]
    assert lines["embedder"]["ok"]
    assert not Model.objects.filter(name__in=["reranker", "rag_pipeline"]).exists()


def test_ensembles_import_after_the_ensembles_of_the_repository_they_use(tmp_path: Path) -> None:
    """`a_outer` uses `b_middle`, which uses `inner`: alphabetical order would judge each first."""
    write_repository(tmp_path, {n: t for n, t in repository_configs().items() if "loop" not in n})
    results = repository_import(path=tmp_path, actor="system:test")
    assert [r.errors for r in results if not r.ok] == []
    assert (
        ModelVersion.objects.filter(model__name__in=["a_outer", "b_middle", "inner"]).count() == 3
    )


def test_ensembles_that_use_each_other_are_a_cycle_and_none_of_it_is_imported(
    tmp_path: Path,
) -> None:
    # tritonserver 2.51 dies loading an ensemble over a cycle; the import refuses it.
    over_loop = Case("over_loop", [step("loop_a", {"TEXT": "TEXT"}, {"LABEL": "LABEL"})], ok=False)
    write_repository(tmp_path, repository_configs() | {"over_loop": over_loop.config("over_loop")})
    results = {r.model: r for r in repository_import(path=tmp_path, actor="system:test")}
    assert {name: r.ok for name, r in results.items() if not r.ok} == {
        "loop_a": False,
        "loop_b": False,
        "over_loop": False,
    }
    assert results["loop_a"].errors == [
        "loop_a: ensemble_scheduling: ensemble cycle: loop_a -> loop_b -> loop_a"
    ]
    for case in REPOSITORY_CASES:
        assert case.says in " ".join(results[case.id].errors)
    assert "model 'loop_a' is not in the registry" in results["over_loop"].errors[0]
    assert not Model.objects.filter(name__in=["loop_a", "loop_b", "over_loop"]).exists()
    assert Model.objects.count() == len(STEPS) + 2


def test_a_refused_version_stores_nothing_and_says_where() -> None:
    import_demo()
    config = parse_pbtxt(
        to_pbtxt(parse_pbtxt((REPOSITORY / "embedder" / "config.pbtxt").read_text()))
    )
    config.max_batch_size = -2
    with pytest.raises(RegistryError, match="embedder: max_batch_size: must be >= 0"):
        version_create(model_name="embedder", config=config, actor="system:test")
    assert ModelVersion.objects.filter(model__name="embedder").count() == 2


def test_published_versions_only_move_forward() -> None:
    import_demo()
    version = ModelVersion.objects.get(model__name="embedder", version=1)
    with pytest.raises(RegistryError, match="cannot go from published to draft"):
        version_set_status(version_id=version.id, status="draft", actor="system:test")
    version_set_status(version_id=version.id, status="deprecated", actor="system:test")
    assert AuditEvent.objects.filter(action="version.set_status", result="ok").count() == 1


def test_a_new_step_version_lists_the_ensembles_it_would_break() -> None:
    import_demo()
    config = parse_pbtxt((REPOSITORY / "retriever" / "config.pbtxt").read_text())
    assert compatibility_breaks(model_name="retriever", config=config) == []
    config.output[0].data_type = config.output[0].data_type + 1  # STRING -> BF16
    breaks = compatibility_breaks(model_name="retriever", config=config)
    assert [str(b.ensemble) for b in breaks] == [
        *(f"rag_pipeline v{v}" for v in range(14, 9, -1)),
        "rag_pipeline v9",
        "rag_pipeline v8",
        "rag_pipeline v7",
        "rag_pipeline v6",
        "rag_pipeline v5",
        "rag_pipeline v4",
        "rag_pipeline v3",
        "rag_pipeline v2",
        "rag_pipeline v1",
    ]
    assert "tensor 'candidates' is TYPE_BF16" in str(breaks[0].problems[0])


def zip_of(entries: dict[str, bytes], *, symlink: str = "", deflate: bool = False) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(
        buffer, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    ) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (zip_of({"../evil/config.pbtxt": b""}), "path leaves the archive"),
        (zip_of({"/abs/config.pbtxt": b""}), "path leaves the archive"),
        (zip_of({}, symlink="m/1/model.py"), "symbolic links are not accepted"),
        (b"not a zip", "not a zip archive"),
        # 20 KB that would unpack to 20 MiB of zeros: under the size cap, not under the ratio.
        (zip_of({"m/1/model.plan": bytes(20 * 2**20)}, deflate=True), "times its size"),
    ],
    ids=["parent", "absolute", "symlink", "not-zip", "bomb"],  # the bytes embed the time
)
def test_unsafe_archives_are_refused(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(ArchiveError, match=message):
        extract_repository(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_real_model_file_is_not_taken_for_a_bomb(tmp_path: Path) -> None:
    weights = random.Random(0).randbytes(2**21)  # weights hardly compress
    data = zip_of({"m/config.pbtxt": b'name: "m"', "m/1/model.plan": weights}, deflate=True)
    assert (extract_repository(data, tmp_path) / "m" / "1" / "model.plan").stat().st_size == 2**21


def test_an_oversized_config_is_refused_before_protobuf_parses_it(tmp_path: Path) -> None:
    """A 21 MB config.pbtxt took protobuf's text parser 26 s."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    huge = 'name: "m"\n' + "# padding\n" * 2_100_000
    (tmp_path / "m" / "config.pbtxt").write_text(huge)
    candidates, failures = read_candidates(tmp_path)
    assert not candidates
    assert failures[0].errors == [
        f"{tmp_path}/m/config.pbtxt:1:1: {len(huge):,} characters; a config may hold 200,000"
    ]


def test_an_archive_with_one_top_directory_is_the_repository(tmp_path: Path) -> None:
    data = zip_of({"repo/m/config.pbtxt": b'name: "m"', "repo/m/1/model.py": b""})
    assert extract_repository(data, tmp_path) == tmp_path / "repo"


# -- pages -------------------------------------------------------------------------------------


@pytest.fixture
def release_manager(db: None) -> User:
    from apps.accounts.roles import Role
    from tests.support.users import make_user

    return make_user(Role.RELEASE_MANAGER)


def test_inline_validation_points_at_the_line(client: Client, viewer: User) -> None:
    import_demo()
    client.force_login(viewer)
    body = client.post(
        "/models/embedder/validate/", {"pbtxt": 'name: "embedder"\nmax_batch_size: x'}
    ).content.decode()
    assert "line 2, column 17" in body and "error" in body


def test_inline_validation_warns_about_ensembles_a_change_breaks(
    client: Client, viewer: User
) -> None:
    import_demo()
    client.force_login(viewer)
    text = (REPOSITORY / "generator" / "config.pbtxt").read_text().replace('"ANSWER"', '"REPLY"')
    body = client.post("/models/generator/validate/", {"pbtxt": text}).content.decode()
    assert "would break" in body and "rag_pipeline v1" in body and "no output" in body


def test_a_viewer_cannot_create_versions_and_the_attempt_is_audited(
    client: Client, viewer: User
) -> None:
    import_demo()
    client.force_login(viewer)
    text = (REPOSITORY / "embedder" / "config.pbtxt").read_text()
    response = client.post("/models/embedder/new/", {"pbtxt": text})
    assert response.status_code == 403
    assert ModelVersion.objects.filter(model__name="embedder").count() == 2
    assert AuditEvent.objects.filter(
        action="version.create", result="denied", actor=viewer.username
    ).exists()


def test_a_release_manager_registers_a_draft(client: Client, release_manager: User) -> None:
    import_demo()
    client.force_login(release_manager)
    text = (REPOSITORY / "embedder" / "config.pbtxt").read_text().replace('"0"', '"5"', 1)
    response = client.post("/models/embedder/new/", {"pbtxt": text, "notes": "slower drill"})
    assert response.status_code == 302 and response["Location"] == "/models/embedder/v3/"
    created = ModelVersion.objects.get(model__name="embedder", version=3)
    assert (created.status, created.author, created.notes) == (
        "draft",
        release_manager,
        "slower drill",
    )


def test_a_broken_config_is_shown_back_and_nothing_is_stored(
    client: Client, release_manager: User
) -> None:
    import_demo()
    client.force_login(release_manager)
    response = client.post("/models/embedder/new/", {"pbtxt": 'name: "embedder" dims: ['})
    assert response.status_code == 422 and "line 1" in response.content.decode()
    assert ModelVersion.objects.filter(model__name="embedder").count() == 2


def test_downloads_give_the_config_and_a_loadable_release_layout(
    client: Client, viewer: User, operator: User
) -> None:
    import_demo()
    client.force_login(viewer)
    config = client.get("/models/rag_pipeline/v2/config.pbtxt")
    assert parse_pbtxt(config.content.decode()).name == "rag_pipeline"
    assert client.get("/models/rag_pipeline/v2/repository.zip").status_code == 403
    client.force_login(operator)  # who may deploy it may have its files
    streamed = client.get("/models/rag_pipeline/v2/repository.zip")
    assert streamed.streaming
    archive = zipfile.ZipFile(io.BytesIO(streamed.getvalue()))
    names = set(archive.namelist())
    assert {
        "rag_pipeline/config.pbtxt",
        "embedder/config.pbtxt",
        "embedder/2/model.py",
        "reranker/2/model.py",
    } <= names
    assert "versions: 2" in archive.read("reranker/config.pbtxt").decode()


def test_upload_of_an_unsafe_archive_is_refused_with_nothing_stored(
    client: Client, release_manager: User
) -> None:
    client.force_login(release_manager)
    upload = io.BytesIO(zip_of({"../../etc/config.pbtxt": b""}))
    upload.name = "repo.zip"
    response = client.post("/models/import/", {"archive": upload})
    assert response.status_code == 422
    assert "path leaves the archive" in response.content.decode()
    assert Model.objects.count() == 0


def test_a_mistake_in_an_uploaded_archive_is_named_by_its_path_inside_it(
    client: Client, release_manager: User
) -> None:
    client.force_login(release_manager)
    upload = io.BytesIO(zip_of({"repo/m/config.pbtxt": b'name: "m"\nbackend: "python"\nbogus: 1'}))
    upload.name = "repo.zip"
    body = unescape(client.post("/models/import/", {"archive": upload}).content.decode())
    (error,) = re.findall(r'<div class="small error">(.*?)</div>', body)
    assert (
        error
        == 'repo/m/config.pbtxt:3:1: Message type "inference.ModelConfig" has no field named "bogus".'
    )


def test_model_list_searches_and_filters(client: Client, viewer: User) -> None:
    import_demo()
    client.force_login(viewer)
    body = client.get("/models/?search=rank").content.decode()
    assert "reranker" in body and "embedder" not in body
    body = client.get("/models/?kind=ensemble").content.decode()
    assert "rag_pipeline" in body and "retriever" not in body


def test_a_release_download_reads_no_file_outside_the_model_repositories(
    client: Client, operator: User
) -> None:
    import_demo()
    ModelVersion.objects.filter(model__name="embedder", version=2).update(artifact="/etc")
    client.force_login(operator)
    streamed = client.get("/models/rag_pipeline/v2/repository.zip")
    archive = zipfile.ZipFile(io.BytesIO(streamed.getvalue()))
    assert archive.read("embedder/2/ARTIFACT") == b"/etc\n"
    assert not [
        name
        for name in archive.namelist()
        if name.startswith("embedder/2/") and name != "embedder/2/ARTIFACT"
    ]


def test_a_version_folder_that_is_not_ascii_digits_is_not_a_version(tmp_path: Path) -> None:
    """ "²" is a digit to Python's str.isdigit but no number to int(), nor a version to Triton."""
    repository = tmp_path / "models"
    shutil.copytree(REPOSITORY / "embedder", repository / "embedder")
    (repository / "embedder" / "²").mkdir()
    (repository / "embedder" / "٣").mkdir()
    results = repository_import(path=repository, actor="system:test")
    assert [(r.model, r.ok) for r in results] == [("embedder", True)]
    assert sorted(ModelVersion.objects.values_list("version", flat=True)) == [1, 2]


def test_an_id_in_the_timeline_address_that_is_no_number_is_ignored(
    client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(viewer)
    for query in ({"rollout": "²"}, {"operation": "²"}):
        assert client.get("/audit/timeline/", query).status_code == 200


def test_a_release_download_past_its_cap_is_refused_before_anything_is_sent(
    client: Client, operator: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    import_demo()
    monkeypatch.setattr(archives, "MAX_RELEASE_BYTES", 1024)
    client.force_login(operator)
    refused = client.get("/models/rag_pipeline/v2/repository.zip", follow=True)
    assert refused.redirect_chain == [("/models/rag_pipeline/v2/", 302)]
    assert "a download may: copy them from the repository" in refused.content.decode()


def test_a_streaming_model_says_so_and_a_response_cache_on_it_is_refused(
    client: Client, viewer: User
) -> None:
    """Triton refuses a decoupled model a response cache (core, model_config_utils.cc); the
    version page says a model streams (the demo's llm), an ensemble over one too (Triton decides
    it from the steps), and how long its answers may be."""
    import_demo()
    streaming = (REPOSITORY / "llm" / "config.pbtxt").read_text()
    cached = parse_pbtxt(streaming + "\nresponse_cache { enable: true }")
    with pytest.raises(RegistryError, match="response_cache: Response Cache does not currently"):
        version_create(model_name="llm", config=cached, actor="ops")
    assert ModelVersion.objects.filter(model__name="llm").count() == 5
    client.force_login(viewer)
    llm = client.get("/models/llm/v1/").content.decode()
    assert "Decoupled: it answers a request with a stream of responses" in llm
    assert "Its answers: 128 tokens at most" in llm
    chat = client.get("/models/rag_pipeline/v10/").content.decode()
    assert "as its decoupled steps make it" in chat
    assert (
        "as its decoupled steps make it"
        not in client.get("/models/rag_pipeline/v2/").content.decode()
    )
    plain = client.get("/models/embedder/v1/").content.decode()
    assert "It answers each request with one response." in plain


def test_an_llms_first_token_objective_is_set_shown_and_checked(
    client: Client, viewer: User
) -> None:
    import_demo()
    out = io.StringIO()
    call_command("set_slo", "generator", "--ttft", "0.99@800", stdout=out)
    assert out.getvalue().strip() == "generator: 99% of first tokens within 800 ms"
    client.force_login(viewer)
    assert (
        "SLO: 99% of first tokens within 800 ms"
        in client.get("/models/generator/").content.decode()
    )
    with pytest.raises(CommandError, match="is not SHARE@MS"):
        call_command("set_slo", "generator", "--ttft", "0.99")
    with pytest.raises(CommandError, match=r"slo_ttft: 1\.5 is not a share between 0 and 1"):
        call_command("set_slo", "generator", "--ttft", "1.5@800")
    call_command("set_slo", "generator", stdout=out)  # none given: none kept
    assert Model.objects.get(name="generator").slo == ""
