"""The P99 chart's endpoint against the raw Prometheus range query it issues, side by side in
one run, over 6 h: at the size on-call opens, a pool of 500 nodes' series for 20 models (10,000
series), where the endpoint must stay within 1.3x its raw query; and a small chart (10 nodes,
5 models), where the endpoint's own fixed cost dominates: reported in milliseconds, not as a
ratio. Run with `make bench` (not part of CI)."""

import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.prometheus.catalog import METRICS, build_query, step_for
from tests.support.backfill import backfilled_prometheus
from tests.support.bench import Report

SPAN = timedelta(hours=6)
TARGET_RATIO = 1.3


def openmetrics(nodes: int, models: int, every_s: int) -> Iterator[str]:
    """Each node's P99 of each model over the last 6 h, a sample every `every_s`."""
    now = int(time.time())
    yield "# HELP nv_inference_request_summary_us latency\n"
    yield "# TYPE nv_inference_request_summary_us summary\n"
    times = range(now - int(SPAN.total_seconds()), now - 30, every_s)
    for node in range(nodes):
        for model in range(models):
            labels = f'model="model-{model:02}",version="1",node="node-{node:04}",pool="bench"'
            series = f'nv_inference_request_summary_us{{{labels},quantile="0.99"}}'
            base = 1000 * (model + 1)
            yield "".join(f"{series} {base + (t + node) % 97} {t}\n" for t in times)
    yield "# EOF\n"


def side_by_side(client: Client, url: str, series: int, rounds: int) -> tuple[float, float]:
    """Median seconds of the raw range query and of the chart endpoint, interleaved, so both
    see the same machine; the first rounds are left out (Prometheus loading its blocks)."""
    end = timezone.now()
    step = step_for(SPAN.total_seconds())
    params = {
        "query": build_query(METRICS["p99"], window_s=max(30, 4 * step)),
        "start": (end - SPAN).timestamp(),
        "end": end.timestamp(),
        "step": f"{step}s",
    }
    raw, chart = [], []
    for _ in range(5 + rounds):
        t0 = time.perf_counter()
        response = requests.get(f"{url}/api/v1/query_range", params=params, timeout=60)
        raw.append(time.perf_counter() - t0)
        assert len(response.json()["data"]["result"]) == series
        t0 = time.perf_counter()
        body = client.get("/metrics/?metric=p99&range=6h", headers={"HX-Request": "true"}).content
        chart.append(time.perf_counter() - t0)
        assert b"metrics-figure" in body
    return statistics.median(raw[5:]), statistics.median(chart[5:])


@pytest.mark.django_db
def test_the_chart_of_a_500_node_pool_costs_at_most_1_3x_its_raw_query(
    tmp_path: Path, client: Client, viewer: User, settings: object, report: Report
) -> None:
    with backfilled_prometheus(tmp_path, openmetrics(500, 20, 60)) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        client.force_login(viewer)
        raw, chart = side_by_side(client, url, series=20, rounds=30)
    ratio = chart / raw
    bench = "P99 chart, 500 nodes x 20 models, 6 h"
    report.add(bench, "raw query, median (ms)", f"{raw * 1000:.1f}")
    report.add(bench, "chart endpoint, median (ms)", f"{chart * 1000:.1f}")
    report.add(bench, "ratio", f"{ratio:.2f}x", f"< {TARGET_RATIO}x")
    assert ratio < TARGET_RATIO, f"the chart endpoint costs {ratio:.2f}x its raw query"


@pytest.mark.django_db
def test_a_small_charts_fixed_cost_is_reported(
    tmp_path: Path, client: Client, viewer: User, settings: object, report: Report
) -> None:
    with backfilled_prometheus(tmp_path, openmetrics(10, 5, 15)) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        client.force_login(viewer)
        raw, chart = side_by_side(client, url, series=5, rounds=150)
    bench = "P99 chart, 10 nodes x 5 models, 6 h"
    report.add(bench, "raw query, median (ms)", f"{raw * 1000:.1f}")
    report.add(bench, "endpoint's own cost, median (ms)", f"{(chart - raw) * 1000:.1f}")
