import ast
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.observability.charts import metric_chart
from apps.prometheus import client as prometheus
from apps.prometheus.catalog import METRICS, build_query, step_for
from apps.prometheus.client import escape_label
from apps.registry.models import Model

APPS = Path(__file__).parents[2] / "apps"
# A metric name, not a pattern such as `nv_gpu_*` in prose.
METRIC_NAME = re.compile(r"\bnv_[a-z0-9_]*[a-z0-9]\b")
# The simulator writes a node's own /metrics text (Triton's exposition format, not PromQL), and
# names its series as Triton does.
SIMULATOR = "apps/devtools/simulator.py"


def test_label_values_cannot_break_out_of_their_quotes() -> None:
    hostile = 'x"} or vector(1) or {a="'
    query = build_query(METRICS["p99"], model=hostile)
    assert escape_label(hostile) == 'x\\"} or vector(1) or {a=\\"'
    assert f'model="{escape_label(hostile)}"' in query


def test_p99_takes_the_worst_node_never_an_average() -> None:
    query = build_query(METRICS["p99"], model="rag_pipeline", pool="demo")
    assert query.startswith("max by (model, version) (nv_inference_request_summary_us{")
    assert 'quantile="0.99",model="rag_pipeline",pool="demo"' in query
    assert "avg" not in query


def test_batch_size_is_inferences_per_execution() -> None:
    query = build_query(METRICS["batch"], model="embedder", window_s=60)
    assert 'rate(nv_inference_count{model="embedder"}[60s])' in query
    assert 'rate(nv_inference_exec_count{model="embedder"}[60s])' in query


def test_steps_keep_charts_at_a_few_hundred_points() -> None:
    for seconds in [900, 3600, 6 * 3600, 7 * 86400]:
        assert seconds / step_for(seconds) <= 450


@pytest.mark.django_db
def test_a_chart_draws_gaps_for_values_a_line_cannot_hold_and_escapes_labels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prometheus stubbed at the client boundary: its rows as the HTTP API writes them."""
    rows = [
        {
            "metric": {"model": "</script><b>", "version": "1"},
            "values": [[1700000000, "12.5"], [1700000015, "NaN"], [1700000030, "+Inf"]],
        },
        {"metric": {"model": "idle", "version": "1"}, "values": [[1700000000, "NaN"]]},
    ]
    monkeypatch.setattr(prometheus, "_call", lambda *args, **kwargs: rows)
    end = datetime.fromtimestamp(1700000040, UTC)
    chart = metric_chart("p99", start=end - timedelta(minutes=15), end=end)
    assert "<" not in chart.figure_json and ">" not in chart.figure_json
    (trace,) = json.loads(chart.figure_json)["data"]  # the idle model has nothing to draw
    assert trace["name"] == "</script><b> v1"
    assert trace["x"] == [1700000000000, 1700000015000, 1700000030000]
    assert trace["y"] == [12.5, None, None]


def test_an_ensembles_version_overlay_says_how_triton_labels_it(
    monkeypatch: pytest.MonkeyPatch, client: Client, viewer: User
) -> None:
    rows = [{"metric": {"model": "rag", "version": "1"}, "values": [[1700000000, "12.5"]]}]
    monkeypatch.setattr(prometheus, "_call", lambda *args, **kwargs: rows)
    Model.objects.create(name="rag", kind=Model.Kind.ENSEMBLE)
    Model.objects.create(name="embedder")
    client.force_login(viewer)
    htmx = {"HX-Request": "true"}

    def page(metric: str, model: str) -> str:
        query = {"metric": metric, "model": model, "range": "1h"}
        return client.get("/metrics/", query, headers=htmx).content.decode()

    assert "version 1 whatever version served" in page("p99", "rag")
    assert "whatever version" not in page("p99_nodes", "rag")  # by node: nothing to warn of
    assert "whatever version" not in page("p99", "embedder")  # a model is labelled right


CATALOG = {"apps/prometheus/catalog.py", "apps/prometheus/llm.py"}  # llm: its LLM meanings


def test_every_query_over_tritons_series_lives_in_the_catalog() -> None:
    found = []
    base = APPS.parent / "controlplane"
    for path in sorted([*APPS.glob("**/*.py"), *base.glob("*.py")]):
        where = path.relative_to(APPS.parent).as_posix()
        if where in {*CATALOG, SIMULATOR} or "/migrations/" in where:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{where}:{node.lineno} {m}" for m in METRIC_NAME.findall(node.value)]
    assert not found, "\n".join(found)
