"""A rollout's own quality metrics judged by the real controller from a real Prometheus,
backfilled (promtool) with Triton's request series and the application's answer counters up to
now: a canary whose helpful-answer ratio is clearly worse than the baseline's is rolled back; one
whose series is missing is inconclusive and pauses, never promoted. Nodes report their READY
versions through their stored index, as the poller would have left it."""

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db.models import F

from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.tick import rollout_advance
from tests.support.backfill import backfilled_prometheus

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

State = Rollout.State
NODES = {"gpu-1": 2, "gpu-2": 1, "gpu-3": 1}  # the node and the version it answers with
HELPFUL = {"gpu-1": 5, "gpu-2": 9, "gpu-3": 9}  # helpful answers per second, of 10
HELPFUL_RATIO = (
    'sum(rate(rag_helpful_total{pool="$pool",node=~"$nodes"}[$window]))'
    ' / sum(rate(rag_answers_total{pool="$pool",node=~"$nodes"}[$window]))'
)
# Only the baseline's version exports grounded answers.
GROUNDED_RATIO = (
    'sum(rate(rag_grounded_total{pool="$pool",version="$version"}[$window]))'
    ' / sum(rate(rag_answers_total{pool="$pool",version="$version"}[$window]))'
)


def openmetrics(times: range) -> str:
    """10 requests a second on every node, none failed, a 20 ms P99; the application's answers
    by node and version, helpful as HELPFUL says, grounded only on the baseline's version."""
    rows: list[tuple[str, str, float, bool]] = []  # name, labels, per second (or gauge), counter
    for node, version in NODES.items():
        triton = f'model="rag",node="{node}",pool="gpu",version="{version}"'
        app = f'node="{node}",pool="gpu",version="{version}"'
        rows += [
            ("nv_inference_request_success", triton, 10, True),
            ("nv_inference_request_failure", f'{triton},reason="BACKEND"', 0, True),
            ("nv_inference_request_summary_us", f'{triton},quantile="0.99"', 20_000, False),
            ("rag_answers_total", app, 10, True),
            ("rag_helpful_total", app, HELPFUL[node], True),
        ]
        if version == 1:
            rows.append(("rag_grounded_total", app, 9, True))
    lines = []
    for name in dict.fromkeys(name for name, *_ in rows):
        lines += [f"# HELP {name} backfilled", f"# TYPE {name} gauge"]
        lines += [
            f"{name}{{{labels}}} {value * (t - times[0]) if counter else value} {t}"
            for each, labels, value, counter in rows
            if each == name
            for t in times
        ]
    return "\n".join(lines) + "\n# EOF\n"


@pytest.fixture(scope="module")
def answers_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    now = int(time.time())
    text = openmetrics(range(now - 600, now + 1, 5))
    with backfilled_prometheus(tmp_path_factory.mktemp("quality-metrics"), text) as url:
        yield url


@pytest.fixture
def pool(answers_prometheus: str, settings: object) -> NodePool:
    """Pool gpu of three nodes serving rag v1; rag v2 registered, to roll out."""
    settings.PROMETHEUS_URL = answers_prometheus  # type: ignore[attr-defined]
    model = Model.objects.create(name="rag")
    for version in (1, 2):
        ModelVersion.objects.create(
            model=model,
            version=version,
            config={"name": "rag", "backend": "python"},
            status=ModelVersion.Status.PUBLISHED,
        )
    pool = NodePool.objects.create(name="gpu")
    for name in NODES:
        Node.objects.create(name=name, pool=pool, http_url=f"http://{name}:8000")
    serving(canary=False)
    deployment_set(model_name="rag", version=1, pool=pool, actor="ops")
    return pool


def serving(*, canary: bool) -> None:
    """What each node's last index read shows READY: v1, and v2 beside it on gpu-1 (the canary
    node) once the reconciler loaded it there."""
    for node in Node.objects.all():
        versions = [1, 2] if canary and node.name == "gpu-1" else [1]
        node.index = [{"model": "rag", "version": str(v), "state": "READY"} for v in versions]
        node.save(update_fields=["index"])


def judged(metric: dict[str, object]) -> Rollout:
    """A rollout of rag v2 on one node, then the pool, with `metric` in its analysis, ticked
    until its first round is due and measured."""
    rollout = rollout_start(
        model_name="rag",
        pool_name="gpu",
        canary_version=2,
        plan="1 node, hold 0s\n100%",
        analysis={
            "judge": "threshold",
            "window_s": 60,
            "warmup_s": 0,
            "failure_limit": 1,
            "metrics": [metric],
        },
        actor="release-manager",
    )
    rollout_advance(rollout_id=rollout.pk)  # the canary goes to gpu-1
    serving(canary=True)
    rollout_advance(rollout_id=rollout.pk)  # READY
    found = Rollout.objects.get(pk=rollout.pk)
    assert (found.state, found.canary_nodes) == (State.PROGRESSING, ["gpu-1"])
    assert found.step_ready_at is not None and found.last_measured_at is None
    # A whole window of canary traffic has passed since (the database's clock moves back, the
    # test does not sleep): measured on this tick.
    earlier = F("step_ready_at") - timedelta(seconds=90)
    Rollout.objects.filter(pk=rollout.pk).update(step_ready_at=earlier)
    rollout_advance(rollout_id=rollout.pk)
    return Rollout.objects.get(pk=rollout.pk)


def test_a_canary_whose_helpful_answers_fall_behind_the_baseline_is_rolled_back(
    pool: NodePool,
) -> None:
    helpful = {"name": "helpful answers", "query": HELPFUL_RATIO, "higher_is_better": True}
    rollout = judged(helpful)
    found = {m.metric: m for m in rollout.measurements.all()}
    assert found["requests"].verdict == "success", found["requests"].detail
    assert (found["p99"].verdict, found["error_ratio"].verdict) == ("success", "success")
    quality = found["custom: helpful answers"]
    assert quality.verdict == "failure"
    assert (quality.canary_value, quality.baseline_value) == (
        pytest.approx(0.5),
        pytest.approx(0.9),
    )
    assert quality.threshold == pytest.approx(0.855)
    assert 'node=~"gpu\\\\-1"}[60s]' in quality.query
    assert 'node=~"gpu\\\\-2|gpu\\\\-3"}[60s]' in quality.query
    assert rollout.state == State.ABORTING
    assert rollout.reason == (
        "failure: custom: helpful answers: canary 0.5 is worse than the baseline's 0.9 by more"
        " than 5% (higher is better; the limit is 0.855)"
    )
    serving(canary=False)  # the reconciler unloaded v2 from gpu-1
    rollout_advance(rollout_id=rollout.pk)
    rollout = Rollout.objects.get(pk=rollout.pk)
    assert rollout.state == State.ROLLED_BACK and rollout.step == 0


def test_a_canary_whose_quality_series_is_missing_is_inconclusive_never_passed(
    pool: NodePool,
) -> None:
    grounded = {"name": "grounded answers", "query": GROUNDED_RATIO, "higher_is_better": True}
    rollout = judged(grounded)
    found = {m.metric: m for m in rollout.measurements.all()}
    assert found["requests"].verdict == "success", found["requests"].detail
    quality = found["custom: grounded answers"]
    assert (quality.verdict, quality.canary_value) == ("inconclusive", None)
    assert quality.baseline_value == pytest.approx(0.9)
    assert 'version="2"' in quality.query and 'version="1"' in quality.query
    detail = "no data for 'grounded answers' from the canary (no series) in the window"
    assert quality.detail == detail
    # Held long enough to go on, it stops instead: a person looks.
    assert (rollout.state, rollout.step, rollout.last_verdict) == (
        State.PAUSED,
        0,
        "inconclusive",
    )
    assert rollout.reason == f"inconclusive: {detail}"
    assert rollout.failures == 0
