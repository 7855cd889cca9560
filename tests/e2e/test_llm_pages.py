"""On-call and the release manager see an LLM step as users feel it: its time to first token
charted from a vLLM backend's series (backfilled into a real Prometheus), and a release whose
longest answer would not fit its budget warned of on the rollout form with the figures, a
release rolled back on its first token, a streamed evaluation run, and a pipeline's budget
split at its LLM step."""

import time

import pytest
from django.core.management import call_command
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import record
from apps.rollouts.verdicts import Verdict
from tests.support.backfill import backfilled_prometheus, llm_series, streaming_pipeline
from tests.support.browser import screenshot, sign_in
from tests.support.quality import demo_faq, wrong_answers
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_time_to_first_token_is_charted_and_a_longest_answer_over_budget_is_warned_of(
    page: Page, live_server: object, settings: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = Model.objects.create(name="generator", latency_budget_ms=2000)
    for version in (3, 4):
        config: dict[str, object] = {"name": "generator", "backend": "python"}
        if version == 4:  # answers with up to 400 tokens, at 20 ms each on this pool
            config["parameters"] = {"max_tokens": {"string_value": "400"}}
        ModelVersion.objects.create(
            model=model, version=version, config=config, status=ModelVersion.Status.PUBLISHED
        )
    pool = NodePool.objects.create(name="gpu")
    for name in ("gpu-1", "gpu-2"):
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    deployment_set(model_name="generator", version=3, pool=pool, actor="ops")
    make_user(Role.RELEASE_MANAGER)
    now = int(time.time())
    text = llm_series(range(now - 1200, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("llm"), text) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        sign_in(page, str(live_server), "release_manager-user")
        page.goto(f"{live_server}/metrics/?metric=ttft_p99&model=generator&pool=gpu&range=15m")
        chart = page.locator("#chart")
        expect(chart.locator("svg.main-svg").first).to_be_visible()
        expect(chart).to_contain_text("Time to first token, P99")
        expect(chart).to_contain_text("generator v3")
        screenshot(page, "metrics-ttft")

        page.goto(f"{live_server}/rollouts/new/?model=generator&pool=gpu")
        page.get_by_label("Canary version").select_option("4")
        page.get_by_label("Plan").fill("100%")
        page.get_by_role("button", name="Preview").click()
        budget = page.locator("#llm-budget")
        expect(budget).to_contain_text("LLM budget not shown to fit")
        expect(budget).to_contain_text(
            "generator v4 (max_tokens 400): first token 298 ms (P99) + 400 tokens x 20.0 ms = "
            "8298 ms, over its budget of 2000 ms"
        )
        screenshot(page, "rollout-llm-budget")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_a_rollout_rolled_back_on_its_first_token_and_a_streamed_run_show_what_users_feel(
    page: Page, live_server: object
) -> None:
    """As the trio recorded them (tests/integration/test_llm_stream.py): rag_pipeline v12, its
    first token twice as slow, rolled back on it while its whole requests were as fast; and an
    evaluation run of the streaming v12 against v10, each answer with its first token."""
    found = demo_faq()
    pool = NodePool.objects.create(name="trio")
    nodes = [
        Node.objects.create(name=f"trio-{n}", pool=pool, http_url=f"http://127.0.0.1:{n}")
        for n in (1, 2, 3)
    ]
    rollout = Rollout.objects.create(
        model=Model.objects.get(name="rag_pipeline"),
        pool=pool,
        baseline_version=10,
        canary_version=12,
        plan=[{"nodes": 1, "hold_s": 60}, {"percent": 100}],
        analysis={"judge": "statistical"},
        state=Rollout.State.ROLLED_BACK,
        canary_nodes=["trio-1"],
        started_by="release_manager-user",
        reason="failure: time to first token (samples): canary +97.7% against the baseline "
        "(tolerance 0.2, margin 5), p=5.39e-05",
        finished_at=timezone.now(),
    )
    where = 'model="llm",pool="trio"'
    record(
        rollout,
        [
            Result(
                "latency (samples)",
                f"sum by (node) (rate(nv_inference_request_duration_us{{{where}}}[4s]))",
                262.0,
                258.0,
                0.1,
                Verdict.SUCCESS,
                "canary +1.6% against the baseline, p=0.41",
                kind=Kind.LATENCY,
            ),
            Result(
                "time to first token (samples)",
                f"sum by (node) (rate(vllm:time_to_first_token_seconds_sum{{{where}}}[4s]))",
                213.0,
                108.0,
                0.2,
                Verdict.FAILURE,
                "canary +97.7% against the baseline (tolerance 0.2, margin 5), p=5.39e-05",
                kind=Kind.TTFT,
            ),
        ],
        Verdict.FAILURE,
    )
    run = wrong_answers(
        found,
        version=12,
        baseline=10,
        right=tuple(c.name for c in found.cases.all()),
        node=nodes[0],
        baseline_node=nodes[1],
    )
    for version, first_ms in ((12, 213.0), (10, 108.0)):
        run.results.filter(version=version).update(first_ms=first_ms, tokens=24, latency_ms=262.0)
    sign_in(page, str(live_server), make_user(Role.RELEASE_MANAGER).username)
    page.goto(f"{live_server}/rollouts/{rollout.pk}/")
    expect(page.locator("#rollout-state")).to_have_text("Rolled back")
    measured = page.locator("table.measurements")
    expect(measured).to_contain_text("time to first token (samples)")
    expect(measured).to_contain_text("canary +97.7% against the baseline")
    screenshot(page, "rollout-rolled-back-ttft")
    page.goto(f"{live_server}/evaluations/runs/{run.pk}/")
    case = page.locator("table.cases tbody.case").first
    expect(case).to_contain_text("v12: first token 213 ms, 24 tokens in 262 ms")
    expect(case).to_contain_text("v10: first token 108 ms, 24 tokens in 262 ms")
    screenshot(page, "quality-run-streamed")
    assert page.console_errors == []  # type: ignore[attr-defined]


def test_the_pipelines_budget_splits_its_llm_step_into_first_token_and_tokens(
    page: Page, live_server: object, settings: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """rag_pipeline v10 serving (found from its steps' series: its own say v1), its LLM step's
    budget split into the first token's P99 and its longest answer's tokens."""
    import_demo()
    call_command("set_budgets", "llm=2000", "rag_pipeline=3000", "embedder=50", "retriever=100")
    now = int(time.time())
    text = streaming_pipeline(range(now - 600, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("split"), text) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        sign_in(page, str(live_server), make_user(Role.VIEWER).username)
        page.goto(f"{live_server}/models/rag_pipeline/")
        split = page.locator(".breakdown")
        expect(split).to_contain_text("Step of v10")
        expect(split).to_contain_text("first token, P99 (15 min)")
        expect(split).to_contain_text("longest answer after it: 128 tokens (max_tokens)")
        expect(split).to_contain_text("128 x 6.0 ms = 768 ms")
        expect(split.locator("tr.split").first).to_contain_text("within")
        expect(split.locator("tr.total")).to_contain_text("420.0 ms")  # its own series say v1
        box = page.locator(".dag .step rect").first  # the pipeline's boxes in their colour
        assert box.evaluate("e => getComputedStyle(e).fill") == "rgb(238, 244, 255)"
        split.scroll_into_view_if_needed()
        screenshot(page, "budget-split")
    assert page.console_errors == []  # type: ignore[attr-defined]
