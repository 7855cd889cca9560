"""Chart endpoint against the raw Prometheus range query it issues, side by side in one run:
6 h of P99 data for 10 nodes and 5 models. Target: the endpoint costs under 1.5x the raw query.
Run with `make bench` (not part of CI)."""

import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from controlplane.catalog import METRICS, build_query, step_for
from tests.support.backfill import backfilled_prometheus

MODELS = ["rag_pipeline", "embedder", "retriever", "reranker", "generator"]
NODES = [f"node-{i}" for i in range(10)]
SPAN = timedelta(hours=6)
ROUNDS = 150
WARMUP = 10


def openmetrics(now: int) -> str:
    lines = [
        "# HELP nv_inference_request_summary_us latency",
        "# TYPE nv_inference_request_summary_us summary",
    ]
    for node in NODES:
        for index, model in enumerate(MODELS):
            labels = f'model="{model}",version="1",node="{node}",pool="bench",quantile="0.99"'
            lines += [
                f"nv_inference_request_summary_us{{{labels}}} {1000 * (index + 1) + t % 97} {t}"
                for t in range(now - int(SPAN.total_seconds()), now - 30, 15)
            ]
    return "\n".join(lines) + "\n# EOF\n"


@pytest.mark.django_db
def test_chart_endpoint_overhead_against_the_raw_query(
    tmp_path: Path, client: Client, viewer: User, settings: object
) -> None:
    now = int(time.time())
    with backfilled_prometheus(tmp_path, openmetrics(now)) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        client.force_login(viewer)
        end = timezone.now()
        start = end - SPAN
        step = step_for(SPAN.total_seconds())
        params = {
            "query": build_query(METRICS["p99"], window_s=max(30, 4 * step)),
            "start": start.timestamp(),
            "end": end.timestamp(),
            "step": f"{step}s",
        }
        raw, chart = [], []
        for _ in range(WARMUP + ROUNDS):  # interleaved, so both see the same machine
            t0 = time.perf_counter()
            response = requests.get(f"{url}/api/v1/query_range", params=params, timeout=30)
            raw.append(time.perf_counter() - t0)
            assert len(response.json()["data"]["result"]) == len(MODELS)
            t0 = time.perf_counter()
            body = client.get(
                "/metrics/?metric=p99&range=6h", headers={"HX-Request": "true"}
            ).content
            chart.append(time.perf_counter() - t0)
            assert b"metrics-figure" in body
        del raw[:WARMUP], chart[:WARMUP]  # Prometheus is still loading the backfilled blocks
    ratio = statistics.median(chart) / statistics.median(raw)
    print(
        f"\nraw query {statistics.median(raw) * 1000:.1f} ms, chart endpoint {statistics.median(chart) * 1000:.1f} ms, ratio {ratio:.2f}x"
    )
    assert ratio < 1.5, f"chart endpoint costs {ratio:.2f}x the raw query"
