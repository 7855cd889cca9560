import zipfile
from pathlib import Path

import pytest
from django.core.management import call_command
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Footprint
from apps.registry.imports import repository_import
from apps.registry.models import Model
from tests.support.browser import screenshot, sign_in
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"


@pytest.fixture
def signed_in(page: Page, live_server: object) -> str:
    repository_import(path=REPOSITORY, actor="system:test")
    call_command("set_budgets", "reranker=80")
    user = make_user(Role.RELEASE_MANAGER)
    sign_in(page, str(live_server), user.username)
    return str(live_server)


def test_a_mistake_in_the_editor_is_shown_inline(page: Page, signed_in: str) -> None:
    page.goto(f"{signed_in}/models/embedder/new/?from=2")
    problems = page.locator("#problems")
    expect(problems).to_contain_text("Valid: Triton would accept this config.")
    editor = page.get_by_label("config.pbtxt")
    editor.fill(editor.input_value().replace("TYPE_FP32", "TYPE_FLOAT"))
    expect(problems).to_contain_text("TYPE_FLOAT")
    expect(problems).to_contain_text("line ")
    screenshot(page, "registry-editor-error")
    editor.fill(editor.input_value().replace("TYPE_FLOAT", "TYPE_FP16"))
    expect(problems).to_contain_text("would break")
    expect(problems).to_contain_text("rag_pipeline v1")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_the_ensemble_is_drawn_as_a_graph(page: Page, signed_in: str) -> None:
    page.goto(f"{signed_in}/models/rag_pipeline/v1/")
    graph = page.get_by_role("img", name="Ensemble graph")
    expect(graph).to_be_visible()
    for step in ["embedder", "retriever", "reranker", "generator"]:
        expect(graph.locator(f"g.node.step:has-text('{step}')")).to_have_count(1)
    expect(graph.locator("g.node.step:has-text('reranker')")).to_contain_text("v1 · budget 80 ms")
    expect(graph.locator("text.edge-label", has_text="candidates")).to_have_count(1)
    expect(page.locator("#problems")).to_contain_text("Valid")
    screenshot(page, "registry-version")


def test_a_version_page_shows_its_measured_footprint(page: Page, signed_in: str) -> None:
    Footprint.objects.create(model_name="generator", version=1, device="cpu", mb=118.4, samples=3)
    call_command("set_memory", "--model-version", "generator:1", "--mb", "150")
    page.goto(f"{signed_in}/models/generator/v1/")
    memory = page.locator("#footprints")
    expect(memory.locator("tbody tr")).to_have_count(1)
    expect(memory.locator("tbody tr")).to_contain_text(
        "CPU118 MiB3the node's memory before and after"
    )
    expect(page.get_by_text("Declared estimate: 150 MiB")).to_be_visible()
    screenshot(page, "registry-version-memory")
    page.goto(f"{signed_in}/models/generator/v2/")
    expect(page.locator("#footprints")).to_contain_text("Not measured yet")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_two_versions_side_by_side(page: Page, signed_in: str) -> None:
    page.goto(f"{signed_in}/models/rag_pipeline/")
    page.get_by_role("link", name="Compare versions").click()
    page.get_by_label("From").select_option("1")
    page.get_by_label("To").select_option("4")
    page.get_by_role("button", name="Compare").click()
    expect(page.get_by_role("heading", name="rag_pipeline: v1 → v4")).to_be_visible()
    removed = page.locator("tr.replace td.old, tr.delete td.old")
    expect(removed.filter(has_text='model_name: "reranker"')).to_have_count(1)
    screenshot(page, "registry-diff")


def test_a_repository_zip_is_checked_then_imported_from_the_models_page(
    page: Page, signed_in: str, tmp_path: Path
) -> None:
    config = (REPOSITORY / "embedder" / "config.pbtxt").read_text()
    archive = tmp_path / "repository.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("sentiment/config.pbtxt", config.replace('"embedder"', '"sentiment"'))
        zipped.writestr("sentiment/1/model.py", "")
        typo = config.replace('"embedder"', '"classifier"').replace("max_batch_size", "max_batch")
        zipped.writestr("classifier/config.pbtxt", typo)
        zipped.writestr("classifier/1/model.py", "")
    page.goto(f"{signed_in}/models/")
    page.get_by_label("Zip of a Triton model repository").set_input_files(archive)
    page.get_by_label("Validate only").check()
    page.get_by_role("button", name="Import").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Repository import")
    rows = page.locator("tbody tr")
    expect(rows.filter(has_text="classifier")).to_contain_text("invalid")
    # Where the mistake is, as a path inside the zip.
    expect(rows.filter(has_text="classifier").locator(".error")).to_have_text(
        'classifier/config.pbtxt:3:1: Message type "inference.ModelConfig" has no field named '
        '"max_batch".'
    )
    expect(page.locator("#validated-only")).to_have_text(
        "Validated only: nothing was stored. What is ok here would be imported."
    )
    expect(rows.filter(has_text="sentiment")).to_contain_text("ok")
    screenshot(page, "registry-import")
    assert not Model.objects.filter(name__in=["sentiment", "classifier"]).exists()

    page.goto(f"{signed_in}/models/")
    page.get_by_label("Zip of a Triton model repository").set_input_files(archive)
    page.get_by_role("button", name="Import").click()
    expect(rows.filter(has_text="sentiment")).to_contain_text("imported 1")
    expect(page.locator("#validated-only")).to_have_count(0)
    assert list(Model.objects.filter(name__in=["sentiment", "classifier"])) == [
        Model.objects.get(name="sentiment")
    ]
