"""Chart endpoints against what the Triton nodes themselves report on `/metrics`, under real
traffic and a real Prometheus scraping them every second."""

import json
import re
import threading
import time
import urllib.request
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.devtools.traffic import send_traffic
from apps.fleet.triton import TritonClient
from apps.observability.tiles import fleet_tiles
from apps.prometheus.catalog import TILE_WINDOW
from apps.prometheus.client import instant_query
from apps.registry.imports import repository_import
from tests.support import REPOSITORY
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')
WINDOW_S = 30  # the rate window of a chart of a few minutes (catalog: 4 steps, 30 s at least)


def triton_metrics(fleet: Fleet) -> dict[str, dict[tuple[str, ...], float]]:
    """Each node's own `/metrics`: {metric: {(node, model, version[, quantile]): value}}."""
    found: dict[str, dict[tuple[str, ...], float]] = defaultdict(dict)
    for proc in fleet.state.nodes:
        url = fleet.state.node_urls(proc)["metrics_url"]
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - local node
            text = response.read().decode()
        for name, labels, value in SAMPLE.findall(text):
            parsed = dict(LABEL.findall(labels))
            if "model" in parsed:
                key = (proc.name, parsed["model"], parsed["version"], parsed.get("quantile", ""))
                found[name][key] = float(value)
    return found


def fleet_total(metrics: dict[tuple[str, ...], float], model: str) -> float:
    return sum(v for (_, m, *_), v in metrics.items() if m == model)


def chart_at(client: Client, metric: str, model: str, at: datetime) -> dict[str, float]:
    """The chart endpoint's value at `at`, per series, over a five-minute custom range ending
    there (so its last point is `at` itself)."""
    start = at - timedelta(minutes=5)
    body = client.get(
        "/metrics/",
        {
            "metric": metric,
            "model": model,
            "range": "custom",
            "start": start.replace(tzinfo=None).isoformat(),
            "end": at.replace(tzinfo=None).isoformat(),
        },
        headers={"HX-Request": "true"},
    ).content.decode()
    found = re.search(r'<script type="application/json" id="metrics-figure">(.*?)</script>', body)
    assert found, f"no figure for {metric}: {body}"
    traces = json.loads(found.group(1))["data"]
    last = {t["name"]: (t["x"][-1], t["y"][-1]) for t in traces}
    for name, (x, _) in last.items():
        assert x == int(at.timestamp() * 1000), f"{name}: last point at {x}, not at {at}"
    return {name: y for name, (_, y) in last.items()}


def test_charts_agree_with_tritons_own_metrics(
    fleet: Fleet, clients: list[TritonClient], client: Client, viewer: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = fleet.state.prometheus_url  # type: ignore[attr-defined]
    client.force_login(viewer)
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    traffic = threading.Thread(
        target=send_traffic,
        args=(clients,),
        kwargs={"model": "rag_pipeline", "rps": 20, "seconds": 5 + WINDOW_S + 8},
    )
    traffic.start()
    time.sleep(5)  # steady traffic before the window opens
    before = triton_metrics(fleet)
    time.sleep(WINDOW_S)
    after = triton_metrics(fleet)
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    time.sleep(2.5)  # Prometheus scrapes every second: it now holds a sample at or after `at`

    # Throughput: the chart's rate at the end of the window against the counters' increase over it.
    served = fleet_total(after["nv_inference_request_success"], "rag_pipeline") - fleet_total(
        before["nv_inference_request_success"], "rag_pipeline"
    )
    charted = chart_at(client, "throughput", "rag_pipeline", at)["rag_pipeline v1"]
    assert served / WINDOW_S == pytest.approx(charted, rel=0.15)
    assert charted == pytest.approx(20, rel=0.25)

    # Average batch size of the dynamically batched embedder, from the same counters.
    requests = fleet_total(after["nv_inference_count"], "embedder") - fleet_total(
        before["nv_inference_count"], "embedder"
    )
    executions = fleet_total(after["nv_inference_exec_count"], "embedder") - fleet_total(
        before["nv_inference_exec_count"], "embedder"
    )
    charted = chart_at(client, "batch", "embedder", at)["embedder v1"]
    assert requests / executions == pytest.approx(charted, rel=0.15)

    # P99: the chart shows the worst node's summary quantile, as each node reports it.
    quantiles = after["nv_inference_request_summary_us"]
    worst_us = max(
        v for (_, m, _, q), v in quantiles.items() if m == "rag_pipeline" and q == "0.99"
    )
    charted = chart_at(client, "p99", "rag_pipeline", at)["rag_pipeline v1"]
    assert worst_us / 1000 == pytest.approx(charted, rel=0.25)

    # The overview's tile counts requests at the pipeline, not again at each of its steps.
    tiles = fleet_tiles()
    ((_, pipeline),) = instant_query(
        f'sum(rate(nv_inference_request_success{{model="rag_pipeline"}}[{TILE_WINDOW}]))'
    )
    assert tiles.throughput_rps == pytest.approx(pipeline, rel=0.05)
    assert tiles.error_ratio == 0
    traffic.join()
