"""An LLM step's series by meaning, whatever the backend, read from a real Prometheus holding a
vLLM backend's and TensorRT-LLM's series (backfilled by promtool): the same charts draw both,
and a release's longest answer is held to its budget on the figures they give."""

import json
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.observability.charts import metric_chart
from apps.observability.llm import Step, fits
from apps.rollouts.analysis import measure
from apps.rollouts.plans import Analysis
from apps.rollouts.slo import Objectives
from tests.support.backfill import backfilled_prometheus, llm_series

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture(scope="module")
def llm_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    with backfilled_prometheus(
        tmp_path_factory.mktemp("llm"), llm_series(range(now - 1200, now + 1, 5))
    ) as url:
        yield url


def drawn(metric: str, model: str) -> dict[str, float] | str:
    """Each trace of the chart, by name: its median (the last points' windows pass the end of
    the series); or what the chart says instead."""
    end = timezone.now()
    chart = metric_chart(
        metric, start=end - timedelta(minutes=10), end=end, model=model, pool="gpu"
    )
    if chart.message:
        return chart.message
    traces = json.loads(chart.figure_json)["data"]
    return {
        t["name"]: statistics.median(y for y in t["y"] if y is not None) for t in traces if "y" in t
    }


@pytest.mark.parametrize(
    ("metric", "generator", "trtllm"),
    [
        # Every first token in one bucket: 0.1 + 0.99 x 0.2 s, and 100 + 0.99 x 400 ms.
        ("ttft_p99", 298.0, 496.0),
        ("ttft_p50", 200.0, 300.0),
        ("output_tokens", 2000.0, 4000.0),  # 10 requests/s on each of 2 nodes
        ("answer_tokens", 100.0, 200.0),
    ],
)
def test_the_same_charts_draw_the_vllm_and_the_tensorrt_llm_series(
    llm_prometheus: str, settings: object, metric: str, generator: float, trtllm: float
) -> None:
    settings.PROMETHEUS_URL = llm_prometheus  # type: ignore[attr-defined]
    assert drawn(metric, "generator") == pytest.approx({"generator v3": generator})
    assert drawn(metric, "trtllm") == pytest.approx({"trtllm v1": trtllm})


def test_time_per_token_waiting_requests_and_kv_cache_where_a_backend_exports_them(
    llm_prometheus: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = llm_prometheus  # type: ignore[attr-defined]
    assert drawn("itl", "generator") == pytest.approx({"generator v3": 20.0})
    # 0.5 GPU-seconds a request of 100 tokens: 5 for 1,000 tokens.
    assert drawn("cost_tokens", "generator") == pytest.approx({"generator v3": 5.0})
    assert drawn("itl", "trtllm") == "No data in this range."  # TensorRT-LLM has none
    assert drawn("llm_waiting", "trtllm") == pytest.approx({"gpu-1": 3.0, "gpu-2": 3.0})
    assert drawn("kv_cache", "trtllm") == pytest.approx({"gpu-1": 60.0, "gpu-2": 60.0})


def test_a_longest_answer_is_held_to_its_budget_on_the_measured_figures(
    llm_prometheus: str, settings: object
) -> None:
    settings.PROMETHEUS_URL = llm_prometheus  # type: ignore[attr-defined]
    over, within, unmeasured = fits(
        [
            Step("generator", 4, max_tokens=100, budget_ms=2000),
            Step("generator", 5, max_tokens=50, budget_ms=2000),
            Step("trtllm", 2, max_tokens=100, budget_ms=2000),
        ],
        "gpu",
    )
    assert (over.ttft_ms, over.itl_ms) == pytest.approx((298.0, 20.0))
    assert over.fits is False and within.fits is True
    assert str(over) == (
        "generator v4 (max_tokens 100): first token 298 ms (P99) + 100 tokens x 20.0 ms = "
        "2298 ms, over its budget of 2000 ms"
    )
    assert unmeasured.fits is None and unmeasured.ttft_ms == pytest.approx(496.0)
    assert str(unmeasured) == (
        "trtllm v2 (max_tokens 100): its budget of 2000 ms cannot be checked (no tokens)"
    )


def test_a_first_token_objective_is_read_from_the_buckets_of_whichever_backend(
    llm_prometheus: str, settings: object
) -> None:
    """Every first token at 200 ms, in vLLM's buckets of seconds (0.1, 0.3]: three in four over
    150 ms, interpolated; the objective allows 1 in 100."""
    settings.PROMETHEUS_URL = llm_prometheus  # type: ignore[attr-defined]
    results = measure(
        model="generator",
        pool="gpu",
        canary_nodes=["gpu-1"],
        spec=Analysis(judge="threshold", window_s=60, slo_short_s=30),
        budget_ms=None,
        steps=[],
        slo=Objectives(None, None, None, ttft=0.99, ttft_ms=150),
    )
    found = {r.metric: r for r in results}["first token burn rate"]
    assert (found.canary, found.baseline) == pytest.approx((75.0, 75.0), rel=0.01)
    assert found.verdict == "failure"


def test_the_kv_cache_guard_reads_tensorrt_llms_blocks(
    llm_prometheus: str, settings: object
) -> None:
    """600 of 1,000 blocks in use on each node: within the guard's 95 %."""
    settings.PROMETHEUS_URL = llm_prometheus  # type: ignore[attr-defined]
    results = measure(
        model="trtllm",
        pool="gpu",
        canary_nodes=["gpu-1"],
        spec=Analysis(judge="threshold", window_s=60),
        budget_ms=None,
        steps=[],
    )
    [guard] = [r for r in results if r.metric == "KV-cache use"]
    assert (guard.canary, guard.baseline) == pytest.approx((0.6, 0.6))
    assert guard.verdict == "success"
