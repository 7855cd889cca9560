"""A degradation trigger's long window holds the long view, on a real Prometheus (its series
backfilled by promtool): a burst of a few seconds fills queues enough that the window's sums read
saturated, and its median slice does not."""

import time
from pathlib import Path

import pytest

from apps.degradation.triggers import Limits, Window, judge
from apps.prometheus.catalog import budget_queries
from apps.prometheus.client import instant_query
from tests.support.backfill import backfilled_prometheus

pytestmark = pytest.mark.integration
COMPUTE_US, QUEUE_US, BURST_US = 1e6, 0.5e6, 80e6  # a second's, summed over requests


def burst_at_the_end(times: range) -> str:
    """The pipeline's queue and compute counters, a second apart: queues at half of compute but
    for a 7-second burst ending 3 s before the last."""
    labels = 'model="rag_pipeline",node="gpu-1",pool="gpu",version="1"'
    queued = computed = 0.0
    rows: dict[str, list[str]] = {
        "nv_inference_queue_duration_us": [],
        "nv_inference_compute_infer_duration_us": [],
    }
    for t in times:
        queued += BURST_US if times[-1] - 10 < t <= times[-1] - 3 else QUEUE_US
        computed += COMPUTE_US
        rows["nv_inference_queue_duration_us"].append(f"{{{labels}}} {queued} {t}")
        rows["nv_inference_compute_infer_duration_us"].append(f"{{{labels}}} {computed} {t}")
    lines = []
    for name, samples in rows.items():
        lines += [f"# HELP {name} backfilled", f"# TYPE {name} counter"]
        lines += [f"{name}{sample}" for sample in samples]
    return "\n".join(lines) + "\n# EOF\n"


def window(window_s: int) -> Window:
    queries = budget_queries(
        model="rag_pipeline", steps=[], pool="gpu", nodes=["gpu-1"], window_s=window_s
    )
    queue, compute, held = (
        rows[0][1] if (rows := instant_query(queries[name])) else None
        for name in ("queue_us", "compute_us", "queue_held")
    )
    return Window(window_s, 400.0, 0.0, 100.0, 0.0, queue, compute, queue_held=held)


def test_a_burst_of_seconds_reads_saturated_in_the_long_windows_sums_not_in_its_median_slice(
    tmp_path: Path, settings: object
) -> None:
    now = int(time.time())
    with backfilled_prometheus(tmp_path, burst_at_the_end(range(now - 600, now + 1))) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
        short, long = window(30), window(120)
    assert short.queue_ratio is not None and short.queue_ratio > 4  # the burst, as it is
    assert long.queue_ratio is not None and long.queue_ratio > 4  # the sums: the burst again
    assert long.queue_held == pytest.approx(QUEUE_US / COMPUTE_US)  # most of the window
    verdict = judge(short, long, Limits(None, None, min_requests=20, max_queue_ratio=4))
    assert not verdict.breached, verdict.evidence
