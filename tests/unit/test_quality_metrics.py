"""The analysis's own (custom) metrics: parsed and checked with the analysis, queried once per
side with that side's nodes and version (Prometheus stubbed at its module boundary), judged
canary against baseline. The same path against a real Prometheus:
tests/integration/test_quality_metrics.py."""

import json
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from apps.fleet.models import NodePool
from apps.prometheus.catalog import custom_query
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.models import Model
from apps.rollouts import analysis
from apps.rollouts.models import Measurement
from apps.rollouts.plans import Analysis, CustomMetric, PlanError

HELPFUL = (
    'sum(rate(rag_helpful_total{pool="$pool",node=~"$nodes"}[$window]))'
    ' / sum(rate(rag_answers_total{pool="$pool",node=~"$nodes"}[$window]))'
)
BY_VERSION = 'avg(rag_hallucination_ratio{pool="$pool",version="$version"})'


def metric(**given: Any) -> dict[str, Any]:
    return {"name": "helpful answers", "query": HELPFUL, "higher_is_better": True} | given


# Parsing -----------------------------------------------------------------------------------------


def test_metrics_are_read_with_the_analysis_and_kept_as_plain_json() -> None:
    spec = Analysis.from_dict(
        {"metrics": [metric(tolerance=0.1, min="0.5"), metric(name="hallucinations", max=0.2)]}
    )
    assert spec.metrics == (
        CustomMetric("helpful answers", HELPFUL, True, tolerance=0.1, min=0.5),
        CustomMetric("hallucinations", HELPFUL, True, tolerance=0.05, max=0.2),
    )
    stored = json.loads(json.dumps(spec.as_dict()))  # as the JSONField keeps it
    assert stored["metrics"][0] == metric(tolerance=0.1, min=0.5)
    assert Analysis.from_dict(stored) == spec
    assert Analysis.from_dict(Analysis().as_dict()) == Analysis()


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"name": "x"}, "analysis.metrics: {'name': 'x'} is not a list"),
        (["x"], "analysis.metrics[0]: 'x' is not an object"),
        ([metric(name="")], "analysis.metrics[0].name: a metric needs one"),
        ([{"name": "x", "higher_is_better": True}], "analysis.metrics[0].query: a metric needs"),
        ([metric(p95=1)], "analysis.metrics[0]: unknown field 'p95'"),
        (
            [metric(query='sum(rag_helpful_total{pool="$pool"})')],
            "analysis.metrics[0].query: names neither $nodes nor $version, so it could not tell",
        ),
        ([metric(query="rag{node=~'$node'}")], "analysis.metrics[0].query: unknown placeholder"),
        ([metric(higher_is_better=None)], "analysis.metrics[0].higher_is_better: true or false"),
        ([metric(tolerance="a lot")], "analysis.metrics[0].tolerance: 'a lot' is not a number"),
        ([metric(tolerance=True)], "analysis.metrics[0].tolerance: True is not a number"),
        ([metric(tolerance=-0.1)], "analysis.metrics[0].tolerance: -0.1 is below 0"),
        ([metric(min="nan")], "analysis.metrics[0].min: 'nan' is not a number"),
        ([metric(min=2, max=1)], "analysis.metrics[0].min: 2 is above max 1"),
        ([metric(), metric()], "analysis.metrics[1].name: 'helpful answers' is named twice"),
    ],
)
def test_a_bad_metric_is_named_by_its_place_and_field(metrics: Any, message: str) -> None:
    with pytest.raises(PlanError) as raised:
        Analysis.from_dict({"metrics": metrics})
    assert str(raised.value).startswith(message)


def test_an_analysis_that_drops_or_loosens_a_templates_metric_is_looser() -> None:
    template = Analysis.from_dict({"metrics": [metric(min=0.5), metric(name="hallucinations")]})
    looser = Analysis.from_dict({"metrics": [metric(tolerance=0.2)]})
    assert looser.looser_than(template) == [
        "metric 'helpful answers': tolerance 0.2, the template's 0.05, min none, the template's 0.5",
        "no metric 'hallucinations', which the template judges",
    ]
    stricter = Analysis.from_dict(
        {
            "metrics": [
                metric(min=0.6, tolerance=0.01),
                metric(name="hallucinations"),
                metric(name="new"),
            ]
        }
    )
    assert stricter.looser_than(template) == []


# Queries per side ------------------------------------------------------------------------------


def test_each_side_gets_exactly_its_own_nodes_and_version() -> None:
    query = custom_query(HELPFUL, pool='g"pu', nodes=["gpu-2", "gpu-10"], version=3, window_s=60)
    assert query == (
        'sum(rate(rag_helpful_total{pool="g\\"pu",node=~"gpu\\\\-10|gpu\\\\-2"}[60s]))'
        ' / sum(rate(rag_answers_total{pool="g\\"pu",node=~"gpu\\\\-10|gpu\\\\-2"}[60s]))'
    )
    # What is put in is not read again: a pool named like a placeholder stays itself.
    assert custom_query(BY_VERSION, pool="$version", nodes=[], version=2, window_s=1) == (
        'avg(rag_hallucination_ratio{pool="$version",version="2"})'
    )


class Prometheus:
    """Triton's request series, enough on every node, and the custom series per side."""

    def __init__(self, canary: list[float], baseline: list[float]) -> None:
        self.values = {"canary": canary, "baseline": baseline}
        self.asked: list[str] = []

    def __call__(self, query: str) -> list[tuple[dict[str, str], float]]:
        if "rag_" not in query:
            return [({"node": n}, 0.0 if "failure" in query else 40.0) for n in NODES]
        self.asked.append(query)
        canary = 'node=~"gpu\\\\-1' in query or 'version="2"' in query
        return [({}, value) for value in self.values["canary" if canary else "baseline"]]


NODES = ("gpu-1", "gpu-2", "gpu-3")


def measure(
    monkeypatch: pytest.MonkeyPatch,
    prometheus: Prometheus,
    *metrics: dict[str, Any],
    compare: bool = True,
) -> list[analysis.Result]:
    monkeypatch.setattr(analysis, "instant_query", prometheus)
    spec = Analysis.from_dict({"judge": "threshold", "metrics": list(metrics)})
    return [
        found
        for found in analysis.measure(
            model="rag",
            pool="gpu",
            canary_nodes=["gpu-1"] if compare else list(NODES),
            spec=spec,
            budget_ms=None,
            steps=[],
            compare=compare,
            canary_version=2,
            baseline_version=1,
            baseline_nodes=["gpu-2", "gpu-3"] if compare else [],
        )
        if found.metric.startswith("custom: ")
    ]


def test_a_canary_worse_than_the_baseline_beyond_tolerance_fails_with_both_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prometheus = Prometheus(canary=[0.6], baseline=[0.9])
    (found,) = measure(monkeypatch, prometheus, metric())
    assert (found.metric, found.canary, found.baseline, found.verdict) == (
        "custom: helpful answers",
        0.6,
        0.9,
        "failure",
    )
    assert found.threshold == pytest.approx(0.855)
    assert found.detail == (
        "canary 0.6 is worse than the baseline's 0.9 by more than 5% (higher is better;"
        " the limit is 0.855)"
    )
    canary, baseline = prometheus.asked
    assert found.query == f"{canary}\n# canary\n{baseline}\n# baseline"
    assert 'node=~"gpu\\\\-1"}[60s]' in canary
    assert 'node=~"gpu\\\\-2|gpu\\\\-3"}[60s]' in baseline
    assert analysis.overall([found]) == "failure"


def test_within_tolerance_it_passes_and_lower_can_be_better(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    helpful = metric()
    hallucinations = metric(name="hallucinations", query=BY_VERSION, higher_is_better=False)
    prometheus = Prometheus(canary=[0.88], baseline=[0.9])
    # 0.88 is above 0.9 less 5% (helpful answers) and below 0.9 plus 5% (hallucinations).
    found = measure(monkeypatch, prometheus, helpful, hallucinations)
    assert [(r.verdict, r.detail) for r in found] == [("success", ""), ("success", "")]
    assert prometheus.asked[2:] == [
        'avg(rag_hallucination_ratio{pool="gpu",version="2"})',
        'avg(rag_hallucination_ratio{pool="gpu",version="1"})',
    ]
    prometheus.values = {"canary": [0.1], "baseline": [0.05]}
    found = measure(monkeypatch, prometheus, hallucinations)[0]
    assert (found.verdict, found.threshold) == ("failure", pytest.approx(0.0525))
    assert "(lower is better; the limit is 0.0525)" in found.detail


@pytest.mark.parametrize(
    ("canary", "baseline", "detail"),
    [
        ([], [0.9], "no data for 'helpful answers' from the canary (no series) in the window"),
        (
            [0.9],
            [float("nan")],
            "no data for 'helpful answers' from the baseline (its value is NaN) in the window",
        ),
        (
            [0.5, 0.6],
            [],
            "no data for 'helpful answers' from the canary (2 series, not one: aggregate them"
            " (sum, avg, max)) nor the baseline (no series) in the window",
        ),
    ],
)
def test_a_side_without_data_is_inconclusive_never_a_pass(
    monkeypatch: pytest.MonkeyPatch, canary: list[float], baseline: list[float], detail: str
) -> None:
    (found,) = measure(monkeypatch, Prometheus(canary, baseline), metric())
    assert (found.verdict, found.detail) == ("inconclusive", detail)
    assert analysis.overall([found]) == "inconclusive"


def test_bounds_fail_a_canary_that_keeps_up_with_a_bad_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (found,) = measure(monkeypatch, Prometheus([0.4], [0.41]), metric(min=0.5))
    assert (found.verdict, found.threshold) == ("failure", 0.5)
    assert found.detail == "canary 0.4 is below the min 0.5"
    (found,) = measure(monkeypatch, Prometheus([0.7], [0.7]), metric(max=0.6))
    assert found.detail == "canary 0.7 is above the max 0.6"


def test_with_no_baseline_left_only_the_bounds_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    prometheus = Prometheus(canary=[0.6], baseline=[0.9])
    assert measure(monkeypatch, prometheus, metric(), compare=False) == []
    assert prometheus.asked == []
    found = measure(
        monkeypatch, prometheus, metric(min=0.5), metric(name="b", min=0.7), compare=False
    )
    assert [(r.verdict, r.baseline, r.threshold) for r in found] == [
        ("success", None, 0.5),
        ("failure", None, 0.7),
    ]
    assert 'node=~"gpu\\\\-1|gpu\\\\-2|gpu\\\\-3"' in found[0].query
    assert "# baseline" not in found[0].query


def test_too_few_requests_leave_a_quality_metric_inconclusive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prometheus = Prometheus(canary=[0.1], baseline=[0.9])
    monkeypatch.setattr(analysis, "instant_query", prometheus)
    results = analysis.measure(
        model="rag",
        pool="gpu",
        canary_nodes=["gpu-1"],
        spec=Analysis(
            judge="threshold", min_requests=100, metrics=(CustomMetric("h", HELPFUL, True),)
        ),
        budget_ms=None,
        steps=[],
    )
    found = results[-1]
    assert (found.verdict, found.detail, found.canary) == (
        "inconclusive",
        "too few requests to judge",
        0.1,
    )
    # Without baseline nodes given, the pool's others are those that served the model.
    assert 'node=~"gpu\\\\-2|gpu\\\\-3"' in prometheus.asked[1]


def test_prometheus_refusing_a_quality_query_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = Prometheus(canary=[], baseline=[])

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        if "rag_" in query:
            raise PrometheusUnavailable("Prometheus at http://prom refused the query: bad_data")
        return triton(query)

    with pytest.raises(PrometheusUnavailable, match="refused the query"):
        measure(monkeypatch, answer, metric())  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_measurements_recorded_as_quality_are_renamed_custom_and_back(
    migrator: MigrationExecutor,
) -> None:
    before = [("rollouts", "0014_notification_of_a_pool")]
    after = [("rollouts", "0015_custom_metric_names")]
    executor = migrator
    executor.migrate(before)
    old = executor.loader.project_state(before).apps  # the rollouts' tables as they were then
    pool = NodePool.objects.create(name="gpu")
    model = Model.objects.create(name="rag_pipeline")
    rollout = old.get_model("rollouts", "Rollout").objects.create(
        model_id=model.pk,
        pool_id=pool.pk,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
    )
    for name in ("quality: helpful answers", "p99", "quality before traffic"):
        old.get_model("rollouts", "Measurement").objects.create(
            rollout=rollout, step=0, metric=name, verdict="success"
        )

    def names() -> set[str]:  # the columns of then: no round yet
        return set(Measurement.objects.only("metric").values_list("metric", flat=True))

    MigrationExecutor(connection).migrate(after)
    assert names() == {"custom: helpful answers", "p99", "quality before traffic"}
    MigrationExecutor(connection).migrate(before)
    assert names() == {"quality: helpful answers", "p99", "quality before traffic"}
    MigrationExecutor(connection).migrate(after)
