"""The quality pages: a model's evaluation sets and their import, a set and its runs, a run's
answers side by side, a version's score history, and the quality gate on the rollout page and
form. Runs and their answers are written straight to the database: no Triton here."""

from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs

import pytest
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.quality.services import evaluation_set_import
from apps.registry.models import Model, ModelVersion
from apps.rollouts.forms import RolloutForm
from apps.rollouts.gate import gate_measured
from apps.rollouts.models import Rollout, Round
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import record
from apps.rollouts.verdicts import Verdict
from apps.rollouts.views import chart_query
from tests.support.quality import DEMO_SET, demo_faq, wrong_answers
from tests.support.users import make_user

pytestmark = pytest.mark.django_db
BAD_LINES = "\n".join(
    [
        '{"name": "ok", "inputs": {"QUESTION": "track my order"}, '
        '"expect": {"SOURCE": {"exact": "faq:orders-track"}}}',
        '{"name": "typo", "inputs": {"QUERY": "where is it"}, '
        '"expect": {"SOURCE": {"exact": "faq:orders-track"}}}',
        '{"name": "broken", "inputs": {',
    ]
)


@pytest.fixture
def release_manager(db: None) -> User:
    return make_user(Role.RELEASE_MANAGER)


@pytest.fixture
def faq(db: None) -> EvaluationSet:
    return demo_faq()


def gated_rollout(run: EvaluationRun) -> Rollout:
    """rag_pipeline v1 -> v7, rolled back by its quality gate before any traffic."""
    pool = NodePool.objects.create(name="trio")
    for n in (1, 2, 3):
        Node.objects.create(name=f"trio-{n}", pool=pool, http_url=f"http://10.0.0.{n}:8000")
    rollout = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        baseline_version=1,
        canary_version=7,
        plan=[{"nodes": 1, "hold_s": 60}, {"percent": 100}],
        analysis={"quality_set": "faq", "quality_min_score": 0.9, "quality_tolerance": 0.05},
        state=Rollout.State.ROLLED_BACK,
        gate_run=run,
        started_by="release_manager-user",
        reason="quality gate failed before any traffic: canary scored 0% (0 of 30 cases)",
        finished_at=timezone.now(),
    )
    gate = gate_measured(run, Analysis.from_dict(rollout.analysis))
    record(rollout, [gate], Verdict.FAILURE, Round.Kind.GATE)
    helpful = Result(
        "custom: helpful",
        'sum(rate(helpful_total{node=~"trio-1"}[1m]))\n# canary',
        0.61,
        0.83,
        0.7885,
        Verdict.FAILURE,
        "canary 0.61 is worse than the baseline's 0.83 by more than 5%",
        kind=Kind.CUSTOM,
    )
    record(rollout, [helpful], Verdict.FAILURE)
    return rollout


# A model's sets, and importing one ------------------------------------------------------------


def test_the_sets_page_lists_a_models_sets_and_the_model_page_links_it(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    client.force_login(viewer)
    model_page = client.get("/models/rag_pipeline/").content.decode()
    assert 'href="/models/rag_pipeline/evaluations/"' in model_page
    response = client.get("/models/rag_pipeline/evaluations/")
    body = response.content.decode()
    assert response.status_code == 200
    assert 'href="/models/rag_pipeline/evaluations/faq/v1/">faq</a>' in body
    assert "<td>30</td><td>release_manager-user</td>" in body
    assert DEMO_SET.name in body
    assert "Import a set" not in body  # a viewer imports nothing
    assert client.get("/models/nope/evaluations/").status_code == 404


def test_newer_set_versions_come_first(client: Client, faq: EvaluationSet, viewer: User) -> None:
    text = DEMO_SET.read_text().splitlines()[0]
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ops")
    client.force_login(viewer)
    body = client.get("/models/rag_pipeline/evaluations/").content.decode()
    assert body.index("<td>v2</td>") < body.index("<td>v1</td>")


def test_a_release_manager_imports_a_file_as_the_sets_next_version(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    client.force_login(release_manager)
    assert "Import a set" in client.get("/models/rag_pipeline/evaluations/").content.decode()
    upload = SimpleUploadedFile("smoke.jsonl", BAD_LINES.splitlines()[0].encode())
    response = client.post(
        "/models/rag_pipeline/evaluations/import/", {"name": "smoke", "file": upload}
    )
    assert response.status_code == 302
    assert response["Location"] == "/models/rag_pipeline/evaluations/smoke/v1/"
    found = EvaluationSet.objects.get(name="smoke")
    assert (found.source, found.created_by, found.cases.get().name) == (
        "smoke.jsonl",
        "release_manager-user",
        "ok",
    )
    again = client.post(
        "/models/rag_pipeline/evaluations/import/",
        {"name": "faq", "file": SimpleUploadedFile("faq.jsonl", DEMO_SET.read_bytes())},
        follow=True,
    )
    assert "faq is unchanged: still v1." in again.content.decode()


def test_a_refused_file_shows_every_problem_by_line_and_field_and_keeps_what_was_given(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    client.force_login(release_manager)
    upload = SimpleUploadedFile("bad.jsonl", BAD_LINES.encode())
    response = client.post(
        "/models/rag_pipeline/evaluations/import/", {"name": "smoke", "file": upload}
    )
    body = response.content.decode()
    assert response.status_code == 422
    assert "Refused: nothing was imported.</strong> 3 problems" in body
    assert (
        "<strong>line 2</strong> <code>inputs.QUESTION</code>: missing</p>" in body
        and "<strong>line 2</strong> <code>inputs.QUERY</code>: no such input; the model&#x27;s: "
        "QUESTION"
        in body
    )
    assert "<strong>line 3</strong> not JSON: " in body
    assert 'name="name" value="smoke"' in body  # the name typed, and the file's cases to fix
    assert "&quot;name&quot;: &quot;typo&quot;, &quot;inputs&quot;: {&quot;QUERY&quot;" in body
    assert not EvaluationSet.objects.filter(name="smoke").exists()
    event = AuditEvent.objects.filter(action="evaluation_set.import").latest("id")
    assert event.result == "failed" and "line 2: inputs.QUESTION: missing" in event.message


def test_pasted_cases_import_and_an_empty_form_says_what_it_needs(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    client.force_login(release_manager)
    empty = client.post("/models/rag_pipeline/evaluations/import/", {"name": "smoke"})
    assert empty.status_code == 422
    assert "choose a JSON Lines file, or paste its cases" in empty.content.decode()
    pasted = {"name": "smoke", "text": BAD_LINES.splitlines()[0]}
    assert client.post("/models/rag_pipeline/evaluations/import/", pasted).status_code == 302
    bad_name = client.post("/models/rag_pipeline/evaluations/import/", pasted | {"name": "a b"})
    assert bad_name.status_code == 422 and "Enter a valid" in bad_name.content.decode()


def test_who_may_not_import_or_run_is_refused_and_recorded(
    client: Client, faq: EvaluationSet, viewer: User, operator: User
) -> None:
    for user in (viewer, operator):
        client.force_login(user)
        imported = client.post(
            "/models/rag_pipeline/evaluations/import/", {"name": "x", "text": BAD_LINES}
        )
        run = client.post("/models/rag_pipeline/evaluations/faq/v1/run/", {"version": "7"})
        assert (imported.status_code, run.status_code) == (403, 403)
    denied = AuditEvent.objects.filter(result="denied").values_list("actor", "action")
    assert sorted(denied) == [
        ("operator-user", "evaluation.start"),
        ("operator-user", "evaluation_set.import"),
        ("viewer-user", "evaluation.start"),
        ("viewer-user", "evaluation_set.import"),
    ]
    assert EvaluationSet.objects.count() == 1 and not EvaluationRun.objects.exists()


# A set's page, and running it -------------------------------------------------------------------


def test_the_set_page_shows_its_cases_with_their_rules_and_its_runs(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    run = wrong_answers(faq)
    client.force_login(viewer)
    response = client.get("/models/rag_pipeline/evaluations/faq/v1/")
    body = response.content.decode()
    assert response.status_code == 200
    assert "<strong>orders-track-1</strong>" in body
    assert "<code>QUESTION</code> How do I track my order?" in body
    assert "<code>SOURCE</code> exactly &quot;faq:orders-track&quot;" in body
    assert f'href="/evaluations/runs/{run.pk}/">#{run.pk}</a>' in body
    assert '<strong class="score">0%</strong>' in body and "100%" in body
    assert "Run it" not in body  # a viewer sends nothing to Triton
    assert client.get("/models/rag_pipeline/evaluations/faq/v2/").status_code == 404
    second = client.get("/models/rag_pipeline/evaluations/faq/v1/?page=2").content.decode()
    assert "contact-1" in second and "orders-track-1" not in second  # 25 cases a page


def test_a_run_that_cannot_start_says_why_in_place(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    client.force_login(release_manager)
    response = client.post(
        "/models/rag_pipeline/evaluations/faq/v1/run/", {"version": "7", "baseline_version": "1"}
    )
    body = response.content.decode()
    assert response.status_code == 422
    assert "no reachable node has rag_pipeline v7 READY" in body
    assert '<option value="7" selected>v7</option>' in body  # what was chosen stays chosen
    same = client.post(
        "/models/rag_pipeline/evaluations/faq/v1/run/", {"version": "7", "baseline_version": "7"}
    )
    assert "a baseline is another version" in same.content.decode()
    assert not EvaluationRun.objects.exists()


def test_a_run_starts_on_a_node_that_has_the_version_ready(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    index = [
        {"model": "rag_pipeline", "version": v, "state": "READY", "reason": ""} for v in (1, 7)
    ]
    pool = NodePool.objects.create(name="trio")
    Node.objects.create(name="trio-1", pool=pool, http_url="http://10.0.0.1:8000", index=index)
    client.force_login(release_manager)
    response = client.post(
        "/models/rag_pipeline/evaluations/faq/v1/run/", {"version": "7", "baseline_version": "1"}
    )
    run = EvaluationRun.objects.get()
    assert response["Location"] == f"/evaluations/runs/{run.pk}/"
    assert (run.version, run.baseline_version, run.node.name, run.requested_by) == (
        7,
        1,
        "trio-1",
        "release_manager-user",
    )


# A run's page ---------------------------------------------------------------------------------


def test_the_run_page_shows_the_changed_answers_side_by_side(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    run = wrong_answers(faq, right=("contact-1",))
    client.force_login(viewer)
    body = client.get(f"/evaluations/runs/{run.pk}/").content.decode()
    assert 'id="run-status">done</span>' in body
    assert "<th>v7</th><th>v1 (baseline)</th>" in body
    assert (
        '<td class="answer wrong differs">faq:contact</td>\n'
        '    <td class="answer differs">faq:orders-track</td>' in body
    )
    assert "expected &quot;faq:orders-track&quot;, got [&quot;faq:contact&quot;]" in body
    assert ">All (30)</a>" in body and ">Failing (29)</a>" in body and ">Changed (29)</a>" in body
    changed = client.get(f"/evaluations/runs/{run.pk}/?only=changed").content.decode()
    assert "orders-track-1" in changed and "<strong>contact-1</strong>" not in changed
    every = client.get(f"/evaluations/runs/{run.pk}/").content.decode()
    assert "<strong>contact-1</strong>" in every
    assert client.get("/evaluations/runs/999999/").status_code == 404


def test_the_run_page_polls_while_the_run_is_open_and_stops_with_286(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    run = EvaluationRun.objects.create(evaluation_set=faq, version=7, requested_by="ops")
    client.force_login(viewer)
    page = client.get(f"/evaluations/runs/{run.pk}/").content.decode()
    assert 'hx-trigger="every 2s"' in page and "waiting for a worker" in page
    live = {"HX-Request": "true", "HX-Target": "run-live"}
    polled = client.get(f"/evaluations/runs/{run.pk}/", headers=live)
    assert polled.status_code == 200
    assert polled.content.decode().lstrip().startswith('<div id="run-live"')
    EvaluationRun.objects.filter(pk=run.pk).update(
        status=EvaluationRun.Status.FAILED, error="no node has rag_pipeline v7 READY"
    )
    final = client.get(f"/evaluations/runs/{run.pk}/", headers=live)
    assert final.status_code == 286
    assert "every 2s" not in final.content.decode()
    assert "no node has rag_pipeline v7 READY" in final.content.decode()


# A version's quality ----------------------------------------------------------------------------


def test_a_versions_quality_shows_its_score_history_and_its_latest_failing_cases(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    older = wrong_answers(faq)
    latest = wrong_answers(faq)
    client.force_login(viewer)
    assert (
        'href="/models/rag_pipeline/v7/quality/"'
        in client.get("/models/rag_pipeline/v7/").content.decode()
    )
    body = client.get("/models/rag_pipeline/v7/quality/").content.decode()
    assert body.index(f">#{latest.pk}</a>") < body.index(f">#{older.pk}</a>")
    assert f'Run <a href="/evaluations/runs/{latest.pk}/">#{latest.pk}</a>' in body
    assert "the first 30 shown" not in body and "<strong>warranty-2</strong>" in body
    none = client.get("/models/rag_pipeline/v2/quality/").content.decode()
    assert "No set has run against this version yet." in none and "No finished run yet." in none
    assert client.get("/models/rag_pipeline/v99/quality/").status_code == 404


# The rollout page and form ----------------------------------------------------------------------


def test_the_rollout_page_shows_the_failed_quality_gate_and_its_failing_cases(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    run = wrong_answers(faq)
    rollout = gated_rollout(run)
    client.force_login(viewer)
    response = client.get(f"/rollouts/{rollout.pk}/")
    body = response.content.decode()
    assert response.status_code == 200
    assert '<section class="card quality-gate" id="quality-gate">' in body
    assert f'<a href="/evaluations/runs/{run.pk}/">evaluation run #{run.pk}</a>' in body
    assert "must score 90% at least, and no more than 5 points below" in body
    assert 'id="gate-verdict">failure</span>' in body
    assert "the first 10 of 30" in body and "<strong>orders-track-1</strong>" in body
    assert "exactly &quot;faq:orders-track&quot;" in body
    assert '<td class="answer wrong differs">faq:contact</td>' in body
    # Its measurements: the gate's row links its run; the analysis's own series is marked so.
    assert f"evaluation run #{run.pk}</a>: 0 passed, 30 failed" in body
    assert 'class="badge custom"' in body and ">custom</span> helpful" in body
    live = {"HX-Request": "true", "HX-Target": "rollout-live"}
    assert client.get(f"/rollouts/{rollout.pk}/", headers=live).status_code == 286


def test_the_rollout_page_of_a_pool_whose_nodes_are_gone_still_renders(
    client: Client, faq: EvaluationSet, viewer: User
) -> None:
    rollout = gated_rollout(wrong_answers(faq))
    Node.objects.all().delete()
    client.force_login(viewer)
    response = client.get(f"/rollouts/{rollout.pk}/")
    assert response.status_code == 200
    assert "0% of requests, on 0 of 0 nodes" in response.content.decode()


def test_the_rollout_chart_spans_the_rollout_not_the_last_15_minutes(
    faq: EvaluationSet,
) -> None:
    rollout = gated_rollout(wrong_answers(faq))
    began = timezone.now() - timedelta(hours=3)
    rollout.created_at, rollout.finished_at = began, None

    def window(now: datetime) -> tuple[str, str]:
        query = parse_qs(chart_query(rollout, now))
        assert query["range"] == ["custom"] and query["metric"] == ["p99_nodes"]
        return query["start"][0], query["end"][0]

    def at(moment: datetime) -> str:
        return f"{moment.astimezone(UTC):%Y-%m-%dT%H:%M:%S}"

    # A minute old: from a minute before it began (not 14 of 15 minutes of nothing) to now.
    now = began + timedelta(minutes=1)
    assert window(now) == (at(began - timedelta(minutes=1)), at(now))
    # Two hours old: five minutes before it, at most.
    now = began + timedelta(hours=2)
    assert window(now) == (at(began - timedelta(minutes=5)), at(now))
    # Finished after 4 minutes: to a minute after that, however late it is looked at.
    rollout.finished_at = began + timedelta(minutes=4)
    assert window(began + timedelta(hours=2)) == (
        at(began - timedelta(minutes=2)),
        at(began + timedelta(minutes=5)),
    )


def test_the_rollout_form_offers_published_versions_with_their_score_and_the_models_sets(
    client: Client, faq: EvaluationSet, release_manager: User
) -> None:
    wrong_answers(faq)
    ModelVersion.objects.filter(model__name="rag_pipeline", version=3).update(
        status=ModelVersion.Status.DRAFT
    )
    client.force_login(release_manager)
    blank = client.get("/rollouts/new/").content.decode()
    assert '<option value="" selected>pick what to release first</option>' in blank
    body = client.get("/rollouts/new/?model=rag_pipeline").content.decode()
    assert '<option value="7">v7: quality 0% (faq)</option>' in body
    assert '<option value="2">v2: no evaluation yet</option>' in body
    assert '<option value="3">' not in body  # a draft is not published
    assert body.index('<option value="7">') < body.index('<option value="1">')
    assert '<option value="faq">faq</option>' in body
    fields = client.get(
        "/rollouts/new/?model=rag_pipeline",
        headers={"HX-Request": "true", "HX-Target": "canary-field"},
    ).content.decode()
    assert fields.lstrip().startswith('<label id="canary-field" >Canary version <select')
    assert '<label id="quality-set-field" hx-swap-oob="true">' in fields
    assert "<form" not in fields


def test_the_rollout_forms_quality_gate_passes_through_the_analysis(
    faq: EvaluationSet,
) -> None:
    NodePool.objects.create(name="trio")
    data = {name: field.initial for name, field in RolloutForm().fields.items() if field.initial}
    data |= {"model": "rag_pipeline", "pool": "trio", "canary_version": "7", "plan": "100%"}
    form = RolloutForm(data | {"quality_set": "faq", "quality_min_score": "0.95"})
    assert form.is_valid(), form.errors
    assert form.analysis() == {"quality_set": "faq", "quality_min_score": 0.95}
    plain = RolloutForm(data)
    assert plain.is_valid() and plain.analysis() == {}  # no set: no gate
    refused = RolloutForm(data | {"canary_version": "99", "quality_set": "nope"})
    assert not refused.is_valid()
    assert refused.errors["canary_version"] == [
        "v99 is not a version of the model with status published."
    ]
    assert "quality_set" in refused.errors
    zero = RolloutForm(data | {"quality_min_score": "0"})
    assert zero.errors["quality_min_score"] == ["a share of the cases: above 0, at most 1"]
