"""A search of a step's config, then its winner released and judged live: on the trio behind
HAProxy the reranker is made the pipeline's bottleneck (one instance, 100 ms a batch); the search,
on the trio's last node held out of traffic, measures rag_pipeline end to end with each config
and names an instance count; released as a tuning rollout under the same saturating load on
every node, the live judge reads from Prometheus that the canary node serves more requests than
each baseline node at no worse P99: the gain the search expected, confirmed. In `make bench`, or
alone: `DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_search_release.py -s -p no:cacheprovider`"""

import time

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.performance.models import PerfSearch
from apps.performance.services import search_start
from apps.quality.services import evaluation_set_import
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.tuning import search_advice, tuning_start
from tests.support.bench import Report
from tests.support.fleet import saturating, until_state, wait_for
from tests.support.quality import DEMO_SET

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# As the tuning benchmark (test_tuning_release.py): a request spends this long in the reranker,
# every node has as many users as three of its full batches.
DELAY_MS = 100
USERS_A_NODE = 24
THROUGHPUT = "custom: rag_pipeline requests/s a node"


@pytest.mark.timeout(900)
def test_a_searched_instance_count_is_confirmed_live_more_requests_at_no_worse_p99(
    trio: tuple[Devfleet, FleetState], haproxy: Proc, tuning_template: str, report: Report
) -> None:
    devfleet, state = trio
    text = DEMO_SET.read_text()  # the pipeline's own inputs, for perf_analyzer
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ci")
    devfleet.fault("reranker", delay_ms=DELAY_MS)
    try:
        began = time.monotonic()
        search = search_start(
            pipeline="rag_pipeline",
            pool_name="trio",
            step="reranker",
            concurrency=USERS_A_NODE,
            requests=400,
            actor="release-manager",
        )
        current = lambda: PerfSearch.objects.get(pk=search.pk)  # noqa: E731
        wait_for("the search ends", lambda: current().finished, timeout=600)
        took = time.monotonic() - began
        search = current()
        assert search.status == PerfSearch.Status.DONE, search.error
        first = search.trials.order_by("id").first()
        winner = search.winner
        assert first is not None and winner is not None and winner.pk != first.pk
        assert winner.fields["instance_group"][0]["count"] >= 2, winner.label
        _, advice = search_advice(search.pk)
        with saturating(state, per_node=USERS_A_NODE, haproxy=haproxy) as load:
            rollout = tuning_start(
                pipeline="rag_pipeline",
                pool_name="trio",
                advice=advice,
                plan="1 node, hold 26s\n100%",
                template=tuning_template,
                actor="release-manager",
            )
            rollout = until_state(
                rollout, Rollout.State.SUCCEEDED, Rollout.State.ROLLED_BACK, timeout=300
            )
            assert rollout.state == Rollout.State.SUCCEEDED, rollout.reason
        assert not [k for k in load.answered if k.endswith("failed")], load.answered
    finally:
        devfleet.fault("reranker")
    canary_step = Measurement.objects.filter(rollout=rollout, step=0).order_by("taken_at", "id")
    last = {m.metric: m for m in canary_step}  # each metric's last round
    rate, p99 = last[THROUGHPUT], last["p99"]
    assert rate.verdict == "success" and rate.canary_value > 1.3 * rate.baseline_value
    assert p99.verdict == "success" and p99.canary_value <= 1.25 * p99.baseline_value
    bench = "search, then its winner as a tuning release (reranker 100 ms a batch)"
    tried = "; ".join(
        f"{t.label} {t.throughput:.0f}/s" for t in search.trials.all() if t.throughput
    )
    report.add(bench, "search on a node out of traffic", f"{took:.0f} s: {tried}")
    report.add(bench, "winner, as searched", f"{winner.label}: {advice.expect}")
    report.add(
        bench,
        "live, canary node against baseline",
        f"{rate.canary_value:.1f} against {rate.baseline_value:.1f} requests/s, P99 "
        f"{p99.canary_value:.0f} against {p99.baseline_value:.0f} ms",
        "more, P99 no worse",
    )
