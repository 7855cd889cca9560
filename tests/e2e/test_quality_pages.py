"""The quality pages in a browser: a model's evaluation sets with a refused upload, a set, a
run's changed answers side by side, a version's quality, a rollout rolled back by its quality
gate or by its performance gate, a search of a step's config, and the rollout form's published
versions. Runs and answers are written straight to the
database (rag_pipeline v7, whose reranker ranks the worst passage first, against v1): no Triton."""

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.performance.models import PerfRun, PerfSearch
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.registry.models import Model, ModelVersion
from apps.rollouts.gate import gate_measured
from apps.rollouts.models import Rollout, Round
from apps.rollouts.perf_gate import perf_results
from apps.rollouts.plans import Analysis
from apps.rollouts.transitions import record
from apps.rollouts.verdicts import Verdict
from tests.support.browser import screenshot, sign_in
from tests.support.quality import demo_faq, perf_gate_runs, wrong_answers
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
# A refused form comes back as 422, which the browser reports in its console.
REFUSED = (
    "Failed to load resource: the server responded with a status of 422 (Unprocessable Entity)"
)


@pytest.fixture
def faq() -> EvaluationSet:
    return demo_faq()


def v7_against_v1(found: EvaluationSet) -> EvaluationRun:
    """The gate's run of rollout #1 on the trio: v7 right on one case only."""
    return wrong_answers(
        found,
        right=("contact-1",),
        node=Node.objects.get(name="trio-1"),
        baseline_node=Node.objects.get(name="trio-2"),
        purpose="rollout #1, before traffic",
    )


@pytest.fixture
def signed_in(page: Page, live_server: object, faq: EvaluationSet) -> str:
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    return str(live_server)


def trio() -> NodePool:
    pool = NodePool.objects.create(name="trio")
    for n in (1, 2, 3):
        Node.objects.create(name=f"trio-{n}", pool=pool, http_url=f"http://127.0.0.1:{n}")
    return pool


def test_the_sets_page_refuses_a_bad_file_naming_each_line_and_field(
    page: Page, signed_in: str
) -> None:
    page.goto(f"{signed_in}/models/rag_pipeline/")
    page.get_by_role("link", name="Evaluation sets").click()
    expect(page.locator("#sets")).to_contain_text("rag_pipeline-faq.jsonl")
    page.get_by_label("Set name").fill("smoke")
    lines = [
        '{"name": "track", "inputs": {"QUESTION": "track my order"}, '
        '"expect": {"SOURCE": {"exact": "faq:orders-track"}}}',
        '{"name": "typo", "inputs": {"QUERY": "where is it"}, '
        '"expect": {"SOURCE": {"exact": "faq:orders-track"}}}',
        '{"name": "rule", "inputs": {"QUESTION": "cancel"}, '
        '"expect": {"SOURCE": {"top_k": ["faq:orders-cancel"], "k": "3"}}}',
    ]
    page.get_by_label("JSON Lines file").set_input_files(
        files=[
            {
                "name": "smoke.jsonl",
                "mimeType": "application/jsonl",
                "buffer": "\n".join(lines).encode(),
            }
        ]
    )
    page.get_by_role("button", name="Import").click()
    problems = page.locator("#problems")
    expect(problems).to_contain_text("Refused: nothing was imported.")
    expect(problems).to_contain_text("line 2 inputs.QUESTION: missing")
    expect(problems).to_contain_text("line 2 inputs.QUERY: no such input; the model's: QUESTION")
    expect(problems).to_contain_text('line 3 expect.SOURCE: "k" is an integer >= 1')
    expect(page.get_by_label("Set name")).to_have_value("smoke")
    expect(page.locator("textarea[name=text]")).to_have_value("\n".join(lines))
    screenshot(page, "quality-sets-refused")
    fixed = "\n".join([lines[0], lines[1].replace("QUERY", "QUESTION")])
    page.locator("textarea[name=text]").fill(fixed)  # fixed in place, imported from there
    page.get_by_role("button", name="Import").click()
    expect(page.locator(".flash")).to_contain_text("smoke v1 imported.")
    expect(page.locator("#cases")).to_contain_text("typo")
    assert EvaluationSet.objects.get(name="smoke").cases.count() == 2
    assert page.console_errors == [REFUSED]  # type: ignore[attr-defined]


def test_a_sets_page_shows_its_cases_and_runs_and_says_why_a_run_cannot_start(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    trio()
    run = v7_against_v1(faq)
    page.goto(f"{signed_in}/models/rag_pipeline/evaluations/")
    page.get_by_role("link", name="faq").click()
    expect(page.locator("#cases")).to_contain_text('SOURCE exactly "faq:orders-track"')
    runs = page.locator("table.runs")
    expect(runs).to_contain_text(f"#{run.pk}")
    expect(runs).to_contain_text("3%")
    expect(runs).to_contain_text("100%")
    page.locator("select[name=version]").select_option("7")
    page.get_by_label("Baseline version").select_option("1")
    page.get_by_role("button", name="Run against Triton").click()
    expect(page.locator("#run-error")).to_have_text("no reachable node has rag_pipeline v7 READY")
    expect(page.locator("select[name=version]")).to_have_value("7")
    screenshot(page, "quality-set")
    assert page.console_errors == [REFUSED]  # type: ignore[attr-defined]


def test_a_runs_page_shows_the_answers_that_changed_side_by_side(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    trio()
    run = v7_against_v1(faq)
    page.goto(f"{signed_in}/evaluations/runs/{run.pk}/")
    expect(page.locator("#run-status")).to_have_text("done")
    expect(page.locator("#run-score")).to_have_text("3%")
    expect(page.locator("#baseline-score")).to_have_text("100%")
    page.get_by_role("link", name="Changed (29)").click()
    table = page.locator("table.cases")
    expect(table.locator("thead")).to_contain_text("v7")
    expect(table.locator("thead")).to_contain_text("v1 (baseline)")
    first = table.locator("tbody").first
    expect(first).to_contain_text("orders-track-1")
    expect(first.locator("td.answer.wrong")).to_have_text("faq:contact")
    expect(first).to_contain_text('expected "faq:orders-track", got ["faq:contact"]')
    expect(table).not_to_contain_text("contact-1")  # it answered as the baseline did
    screenshot(page, "quality-run-changed")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_versions_quality_shows_its_scores_and_latest_failing_cases(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    trio()
    run = v7_against_v1(faq)
    page.goto(f"{signed_in}/models/rag_pipeline/v7/")
    page.get_by_role("link", name="Quality: evaluation scores").click()
    expect(page.locator("h1")).to_contain_text("Quality of rag_pipeline v7")
    expect(page.locator("table.runs")).to_contain_text(f"#{run.pk}")
    expect(page.locator("table.runs")).to_contain_text("faq v1")
    expect(page.locator("table.cases")).to_contain_text("warranty-2")
    screenshot(page, "quality-version")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_rollout_rolled_back_by_its_quality_gate_lists_the_failing_cases(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    pool = trio()
    run = v7_against_v1(faq)
    rollout = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        baseline_version=1,
        canary_version=7,
        plan=[{"nodes": 1, "hold_s": 60}, {"percent": 50, "hold_s": 60}, {"percent": 100}],
        analysis={"quality_set": "faq"},
        state=Rollout.State.ROLLED_BACK,
        gate_run=run,
        canary_nodes=["trio-1"],
        started_by="release_manager-user",
        reason="quality gate failed before any traffic: canary scored 3% (1 of 30 cases), "
        "below 90%; failing: orders-track-1, orders-track-2, orders-cancel-1, "
        "orders-change-address-1, shipping-time-1, ...",
        finished_at=timezone.now(),
    )
    gate = gate_measured(run, Analysis.from_dict(rollout.analysis))
    record(rollout, [gate], Verdict.FAILURE, Round.Kind.GATE)
    page.goto(f"{signed_in}/rollouts/{rollout.pk}/")
    expect(page.locator("#rollout-state")).to_have_text("Rolled back")
    gate = page.locator("#quality-gate")
    expect(gate).to_contain_text("faq v1")
    expect(gate).to_contain_text("canary v7 3% against baseline v1 100%")
    expect(gate).to_contain_text("It must score 90% at least, and no more than 5 points below")
    expect(page.locator("#gate-verdict")).to_have_text("failure")
    expect(gate).to_contain_text("the first 10 of 29")
    expect(gate.locator("table.cases")).to_contain_text("orders-track-1")
    expect(gate.locator("table.cases")).to_contain_text('exactly "faq:orders-track"')
    expect(page.locator("table.measurements")).to_contain_text(f"evaluation run #{run.pk}")
    screenshot(page, "quality-rollout-gate")
    gate.get_by_role("link", name=f"evaluation run #{run.pk}").click()
    expect(page.locator("h1")).to_contain_text(f"Evaluation run #{run.pk}")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_rollout_stopped_by_its_performance_gate_draws_its_runs_as_curves(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    rollout = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=trio(),
        baseline_version=15,
        canary_version=16,
        plan=[{"nodes": 1, "hold_s": 600}, {"percent": 100}],
        analysis={"perf_concurrency": "1:4:3", "perf_requests": 120},
        state=Rollout.State.ROLLED_BACK,
        canary_nodes=["trio-1"],
        started_by="release_manager-user",
        reason="performance gate failed before any traffic",
        finished_at=timezone.now(),
    )
    # At 1 user as fast as the baseline; at 4, half its requests a second.
    runs = perf_gate_runs(
        rollout, [(16, 25.5, 170.0), (15, 50.2, 90.0), (15, 49.0, 92.0), (16, 24.9, 168.0)]
    )
    for run, rate in zip(runs, (22.0, 22.6, 22.4, 21.8), strict=True):
        run.points.create(
            concurrency=1,
            throughput=rate,
            p50_ms=43,
            p90_ms=46,
            p99_ms=49,
            queue_us=80,
            compute_us=42000,
        )
    PerfRun.objects.update(concurrencies=[1, 4, 3])
    spec = Analysis.from_dict(rollout.analysis)
    record(rollout, perf_results(runs, spec), Verdict.FAILURE, Round.Kind.PERF)
    page.goto(f"{signed_in}/rollouts/{rollout.pk}/")
    gate = page.locator("#perf-gate")
    expect(page.locator("#perf-verdict")).to_have_text("failure")
    expect(gate).to_contain_text("the canary served 25.2 requests a second, the baseline 49.6")
    expect(gate.locator("#perf-runs tbody tr")).to_have_count(8)
    expect(gate.locator(".plot .main-svg").first).to_be_visible()
    expect(gate.locator(".plot .scatterlayer .trace")).to_have_count(4)
    screenshot(page, "perf-gate")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_search_page_shows_each_configuration_against_the_budget_and_its_winner(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    pipeline = Model.objects.get(name="rag_pipeline")
    Model.objects.filter(pk=pipeline.pk).update(latency_budget_ms=300)
    search = PerfSearch.objects.create(
        pipeline=pipeline,
        version=16,
        step="reranker",
        pool_name=trio().name,
        node=Node.objects.get(name="trio-3"),
        node_name="trio-3",
        concurrency=4,
        requests=120,
        budget_ms=300,
        status=PerfSearch.Status.DONE,
        requested_by="release_manager-user",
        finished_at=timezone.now(),
    )
    # One instance, 40 ms a request: 4 users are served 25 a second; two instances twice that,
    # four a little more, eight nothing more; a larger batch nothing more either.
    trials = [
        search.trials.create(
            fields={"instance_group": [{"count": n}]} if n > 1 else {},
            label=f"{n} instance{'s' if n > 1 else ''}, batch 8",
            throughput=rate,
            p99_ms=p99,
            queue_us=queue,
            compute_us=41000,
        )
        for n, rate, p99, queue in [
            (1, 24.8, 168.0, 118000),
            (2, 49.5, 86.0, 39000),
            (4, 90.1, 47.0, 900),
            (8, 91.0, 47.5, 850),
        ]
    ]
    search.trials.create(
        fields={"instance_group": [{"count": 4}], "max_batch_size": 16},
        label="4 instances, batch 16",
        error="trio-3: Triton refused the load: max_batch_size 16 exceeds the ensemble's",
    )
    PerfSearch.objects.filter(pk=search.pk).update(winner=trials[2])
    page.goto(f"{signed_in}/pipelines/rag_pipeline/searches/")
    expect(page.locator("#searches tbody tr")).to_contain_text("4 instances, batch 8 90.1/s")
    expect(page.locator("#no-pool")).to_have_text(
        "No pool runs rag_pipeline: there is no node to search on."
    )
    screenshot(page, "searches")
    page.get_by_role("link", name=f"#{search.pk}").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(
        f"Search #{search.pk}: reranker in rag_pipeline v16"
    )
    expect(page.locator("#trials tbody tr")).to_have_count(5)
    expect(page.locator("#trials tr.winner")).to_contain_text("4 instances, batch 8")
    expect(page.locator("#trials")).to_contain_text("max_batch_size 16 exceeds the ensemble's")
    expect(page.locator("#winner")).to_contain_text("263% more")
    expect(page.locator("#search .plot .scatterlayer .trace")).to_have_count(3)
    expect(page.get_by_role("button", name="Release it as a tuning rollout")).to_be_visible()
    screenshot(page, "search")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_the_rollout_form_offers_the_models_published_versions_with_their_scores(
    page: Page, signed_in: str, faq: EvaluationSet
) -> None:
    trio()
    v7_against_v1(faq)
    ModelVersion.objects.filter(model__name="rag_pipeline", version=3).update(
        status=ModelVersion.Status.DEPRECATED
    )
    page.goto(f"{signed_in}/rollouts/new/")
    canary = page.get_by_label("Canary version")
    expect(canary.locator("option")).to_have_text(["pick what to release first"])
    page.get_by_label("Model").select_option("rag_pipeline")
    expect(canary.locator("option[value='7']")).to_have_text("v7: quality 3% (faq)")
    expect(canary.locator("option[value='3']")).to_have_count(0)
    canary.select_option("7")
    page.get_by_label("Evaluation set").select_option("faq")
    page.get_by_label("Min score (share of cases)").fill("0.95")
    screenshot(page, "quality-rollout-form")
    assert page.console_errors == []  # type: ignore[attr-defined]
