"""Gray rollouts on 3 real Triton nodes under real traffic, judged from a real Prometheus by the
real worker and beat: nothing here is stubbed."""

import json
import re
from datetime import timedelta
from html import unescape

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.registry.services import model_set_budget, model_set_fallback, model_set_slo
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import release_fallback, release_rollback, rollout_promote
from tests.support.fleet import (
    ANALYSIS,
    HEALTHY,
    STEPS_V1,
    STEPS_V2,
    converged,
    ready_on,
    until_state,
    wait_for,
)
from tests.support.services import Celery, Webhook
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

State = Rollout.State


def start(pool: NodePool, canary: int, plan: str, **analysis: object) -> Rollout:
    return rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=canary,
        plan=plan,
        analysis={**ANALYSIS, **analysis},
        actor="release-manager",
    )


def test_a_better_release_rolls_out_by_itself(
    serving_v1: NodePool, traffic: None, webhook: Webhook, settings: object
) -> None:
    settings.ROLLOUT_WEBHOOK_URL = webhook.url  # type: ignore[attr-defined]
    webhook.failures = 1  # the first delivery fails and is retried
    rollout = start(serving_v1, 2, "1 node, hold 6s\n100%", **HEALTHY)
    rollout = until_state(rollout, State.SUCCEEDED, State.PAUSED, State.ROLLED_BACK)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    wait_for("v2 alone on every node", converged(serving_v1, STEPS_V2), timeout=60)
    judged = rollout.measurements.filter(metric="p99", verdict="success")
    assert {m.step for m in judged} == {0, 1}
    first = judged.last()
    assert first and first.canary_value and first.baseline_value  # both sides measured
    assert 'model="rag_pipeline",pool="trio"' in first.query

    def delivered() -> set[str]:
        return {m["rollout"]["event"] for m in webhook.received if m["rollout"]["id"] == rollout.pk}

    wanted = {"started", "step", "promoting", "succeeded"}
    wait_for(f"the webhook heard of {wanted}", lambda: wanted <= delivered(), timeout=60)
    ours = [m for m in webhook.received if m["rollout"]["id"] == rollout.pk]  # the session's
    assert all(f"/rollouts/{rollout.pk}/" in m["text"] for m in ours)
    notifications = rollout.notifications.all()
    # The receiver has a message before its worker records it sent: wait for the records.
    wait_for(
        "every message recorded sent", lambda: all(n.status == "sent" for n in notifications.all())
    )
    assert notifications.get(event="started").attempts == 2  # refused once, then delivered


def test_a_worker_killed_mid_step_resumes_without_repeating_it(
    serving_v1: NodePool, traffic: None, celery: Celery
) -> None:
    rollout = start(serving_v1, 2, "1 node, hold 12s\n100%", **HEALTHY)
    wait_for("step 1 is being judged", lambda: Rollout.objects.get(pk=rollout.pk).last_verdict)
    celery.kill_worker()  # SIGKILL, mid-step: the rollout row is all that is left
    celery.start_worker()
    rollout = until_state(rollout, State.SUCCEEDED, State.PAUSED, State.ROLLED_BACK)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    steps = AuditEvent.objects.filter(
        action="rollout.step", target__startswith=f"rollout:{rollout.pk}:"
    )
    assert [e.after["step"] for e in steps.order_by("id")] == [0, 1]  # each step began once
    canary_loads = Operation.objects.filter(
        node__name="trio-1", model_name="rag_pipeline", versions=[1, 2], status="succeeded"
    )
    assert canary_loads.count() == 1


# The statistical judge: each node's mean latency every 2 s over the last 10 s, canary against
# baseline, after a short warm-up; no wide margin for the healthy release here.
STATISTICAL = {"judge": "statistical", "sample_s": 2, "warmup_s": 2}


# As the marginal test below: with another test's fleet on the same two cores, the canary
# node's requests were measured 27 % (5 ms) slower than the baseline's once (p=0.018, a fresh
# clone's CI, 2026-12-04), and the healthy release was judged a failure. It runs alone.
@pytest.mark.alone
def test_the_statistical_judge_passes_a_healthy_release_after_a_short_warm_up(
    serving_v1: NodePool, traffic: None
) -> None:
    rollout = start(serving_v1, 2, "1 node, hold 10s\n100%", **STATISTICAL)
    rollout = until_state(rollout, State.SUCCEEDED, State.PAUSED, State.ROLLED_BACK)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    judged = rollout.measurements.filter(metric="latency (samples)", step=0)
    assert judged.exists() and not judged.filter(verdict="failure").exists()
    evidence = judged.first().evidence  # type: ignore[union-attr]
    assert len(evidence["canary"]) >= 3 and len(evidence["baseline"]) >= 3
    assert 0 <= evidence["p"] <= 1


def test_the_statistical_judge_rolls_a_slow_release_back(
    serving_v1: NodePool, traffic: None
) -> None:
    rollout = start(serving_v1, 3, "1 node, hold 60s\n100%", failure_limit=1, **STATISTICAL)
    rollout = until_state(rollout, State.ROLLED_BACK, State.SUCCEEDED, State.PAUSED)
    assert rollout.state == State.ROLLED_BACK, rollout.reason
    failing = rollout.measurements.get(metric="latency (samples)", verdict="failure")
    assert failing.evidence["p"] < 0.05 and failing.evidence["effect"] > 0.1
    wait_for("v1 alone everywhere", converged(serving_v1, STEPS_V1), timeout=60)


# It tells 1.5 ms apart from the 5 ms margin: with another test's fleet on the same two cores,
# one node's requests were measured 6 ms slower (CI, 2026-12-02), a failure. It runs alone.
@pytest.mark.alone
def test_a_canary_a_few_percent_slower_is_judged_marginal_not_failed(
    serving_v1: NodePool, traffic: None
) -> None:
    """v6 is v2 with 1.5 ms more in the reranker (10 to 25 % slower), against v2: a real
    difference, within the default 5 ms latency margin, so never a failure. The default analysis
    (the statistical judge) at test pace, over a 30 s window of 2 s samples (15 a side), several
    times over. (0.7 ms was proven too rarely with another test's fleet busy beside it.)"""
    deployment_set(model_name="rag_pipeline", version=2, pool=serving_v1, actor="system:test")
    wait_for("v2 everywhere", converged(serving_v1, STEPS_V2), timeout=90)
    rollout = rollout_start(
        model_name="rag_pipeline",
        pool_name=serving_v1.name,
        canary_version=6,
        plan="1 node, hold 50s\n100%",
        analysis={"interval_s": 2, "window_s": 30, "warmup_s": 2, "sample_s": 2},
        actor="release-manager",
    )
    rollout = until_state(rollout, State.SUCCEEDED, State.PAUSED, State.ROLLED_BACK, timeout=200)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    judged = rollout.measurements.filter(metric="latency (samples)", step=0)
    assert judged.count() >= 5 and not judged.filter(verdict="failure").exists()
    slower = [m.evidence for m in judged if m.evidence["effect"] > 0]
    assert len(slower) > judged.count() / 2  # the canary was mostly measured slower...
    assert judged.filter(verdict="marginal").exists()  # ...and proven so, at least once
    print("effects:", [f"{m.evidence['effect']:+.1%} p={m.evidence['p']:.2g}" for m in judged])


# The SLO gate at test pace: burn rates over the last 4 s and the whole 10 s window. The
# threshold judge's own error check is switched off (`error_delta` 1), so that only the gate can
# fail a release for its errors.
SLO_GATE = {"slo_short_s": 4, "error_delta": 1.0, "failure_limit": 1, **HEALTHY}


def test_the_slo_gate_passes_a_healthy_release_and_rolls_back_one_that_fails_requests(
    serving_v1: NodePool, traffic: None
) -> None:
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=3000, actor="sre")
    model_set_slo(model_name="rag_pipeline", availability=0.999, latency=0.99, actor="sre")
    healthy = until_state(
        start(serving_v1, 2, "1 node, hold 10s\n100%", **SLO_GATE),
        State.SUCCEEDED,
        State.PAUSED,
        State.ROLLED_BACK,
    )
    assert healthy.state == State.SUCCEEDED, healthy.reason
    for metric in ("availability burn rate", "latency burn rate"):
        gated = healthy.measurements.filter(metric=metric)
        assert gated.filter(step=0, verdict="success").exists(), metric
        assert not gated.filter(verdict__in=["failure", "marginal"]).exists(), metric
    wait_for("v2 everywhere", converged(serving_v1, STEPS_V2), timeout=60)

    # v5's reranker fails one request in five: 200x the budget of a 99.9 % objective.
    failing = until_state(
        start(serving_v1, 5, "1 node, hold 60s\n100%", **SLO_GATE),
        State.ROLLED_BACK,
        State.SUCCEEDED,
        State.PAUSED,
    )
    assert failing.state == State.ROLLED_BACK, failing.reason
    assert failing.reason.startswith("failure: availability burn rate"), failing.reason
    burned = failing.measurements.get(metric="availability burn rate", verdict="failure")
    assert burned.canary_value is not None and burned.canary_value > 14.4
    assert burned.baseline_value == 0  # the nodes on v2 failed nothing
    assert not failing.measurements.filter(metric="error_ratio", verdict="failure").exists()
    wait_for("v2 alone everywhere", converged(serving_v1, STEPS_V2), timeout=60)


def test_a_lockstep_release_rolls_back_both_models_when_one_fails(
    serving_v1: NodePool, traffic: None, client: Client
) -> None:
    """The embedder v2 is healthy, the pipeline v3 released with it is slow: both go to the
    same canary node, the pipeline fails the step, and both come back, as one release."""
    deployment_set(model_name="embedder", version=1, pool=serving_v1, actor="system:test")
    rollout = rollout_start(
        model_name="embedder",
        pool_name=serving_v1.name,
        canary_version=2,
        lockstep=[("rag_pipeline", 3)],
        plan="1 node, hold 60s\n100%",
        analysis={**ANALYSIS, "failure_limit": 1},
        actor="release-manager",
    )
    rollout = until_state(rollout, State.ROLLED_BACK, State.SUCCEEDED, State.PAUSED)
    assert rollout.state == State.ROLLED_BACK, rollout.reason
    # The pipeline's own p99 may fail beside it (v3 is 250 ms slower): the member is named.
    assert rollout.reason.startswith("failure: ") and "rag_pipeline: " in rollout.reason
    canary = Node.objects.get(name=rollout.canary_nodes[0])
    loaded = Operation.objects.filter(node=canary, kind="load")
    assert {("embedder", 2), ("rag_pipeline", 3)} <= {
        (op.model_name, max(op.versions)) for op in loaded
    }
    # The pipeline's failure decided it. (The embedder's own P99 is no verdict to hold here:
    # a fresh canary's first requests stay in Triton's P99 summary for its age window, and on a
    # busy machine they can fail the embedder's few milliseconds too.)
    assert rollout.measurements.filter(
        metric__startswith="rag_pipeline: ", verdict="failure"
    ).exists()
    wait_for("v1 alone everywhere", converged(serving_v1, STEPS_V1), timeout=60)

    client.force_login(make_user(Role.VIEWER))
    page = client.get("/audit/timeline/", {"rollout": rollout.pk}).content.decode()
    assert f"rollout #{rollout.pk}: embedder v1 → v2 with rag_pipeline v1 → v3 on trio" in page
    assert page.count("<strong>rollout.start</strong>") == 1
    assert page.count("<strong>rollout.rolled_back</strong>") == 1
    for model in ("embedder", "rag_pipeline"):
        assert f"<strong>deployment.set</strong> node:{canary.name}:{model}" in page


def test_after_a_promotion_the_release_before_stays_loaded_and_a_rollback_only_narrows(
    serving_v1: NodePool,
) -> None:
    NodePool.objects.filter(pk=serving_v1.pk).update(rollback_window_s=300)
    # Promoted by a person, not judged (no traffic, nothing to judge): what follows a promotion is
    # under test here, and a judge on two busy cores rolled this healthy v2 back in CI.
    rollout = start(serving_v1, 2, "1 node, hold 600s\n100%")
    wait_for("the canary is READY", lambda: Rollout.objects.get(pk=rollout.pk).step_ready_at)
    rollout_promote(rollout_id=rollout.pk, reason="its flow is under test", actor="release-manager")
    rollout = until_state(rollout, State.SUCCEEDED, State.PAUSED, State.ROLLED_BACK)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    # v1 loaded, not served: unversioned requests go to the highest version, v2.
    wait_for("v1 kept beside v2", converged(serving_v1, STEPS_V1 | STEPS_V2), timeout=60)
    clicked = timezone.now()
    assert release_rollback(model_name="rag_pipeline", pool_name="trio", actor="oncall") == 1
    wait_for("v1 alone everywhere", converged(serving_v1, STEPS_V1), timeout=60)
    after = Operation.objects.filter(node__pool=serving_v1, created_at__gte=clicked)
    assert after.exists()
    assert all(op.kind == "load" and op.versions == [1] for op in after)  # narrowing only


def test_without_traffic_a_rollout_pauses_as_inconclusive(serving_v1: NodePool) -> None:
    rollout = start(serving_v1, 2, "1 node, hold 3s\n100%")
    rollout = until_state(rollout, State.PAUSED, State.SUCCEEDED, State.ROLLED_BACK)
    assert rollout.state == State.PAUSED
    assert rollout.reason.startswith("inconclusive: canary served 0")
    assert not rollout.measurements.filter(verdict="success", metric="p99").exists()


def test_with_prometheus_down_a_rollout_never_promotes(
    serving_v1: NodePool, traffic: None, trio: tuple[Devfleet, FleetState]
) -> None:
    devfleet, _ = trio
    rollout = start(serving_v1, 2, "1 node, hold 60s\n100%", error_limit=3)
    wait_for("the canary is READY", lambda: Rollout.objects.get(pk=rollout.pk).step_ready_at)
    devfleet.kill("prometheus")
    try:
        rollout = until_state(rollout, State.ROLLED_BACK, State.SUCCEEDED, State.PAUSED)
    finally:
        devfleet.restart("prometheus")
    assert rollout.state == State.ROLLED_BACK
    assert rollout.reason.startswith("error: Prometheus failed 3 times in a row")
    assert rollout.measurements.filter(verdict="error").count() >= 3
    wait_for("v1 alone everywhere", converged(serving_v1, STEPS_V1), timeout=60)


def test_one_click_rollback_and_fallback_converge_the_pool(serving_v1: NodePool) -> None:
    deployment_set(model_name="rag_pipeline", version=2, pool=serving_v1, actor="system:test")
    wait_for("v2 on every node", converged(serving_v1, STEPS_V2))
    assert release_rollback(model_name="rag_pipeline", pool_name="trio", actor="oncall") == 1
    wait_for("back on v1 everywhere", converged(serving_v1, STEPS_V1))
    model_set_fallback(model_name="rag_pipeline", version=4, actor="release-manager")
    assert release_fallback(model_name="rag_pipeline", pool_name="trio", actor="oncall") == 4

    def on_fallback() -> bool:
        return all(
            {v for m, v in ready_on(node) if m == "rag_pipeline"} == {4}
            for node in serving_v1.nodes.all()
        )

    wait_for("the fallback v4 everywhere", on_fallback)


# Last in this module: a node's P99 summary remembers v3's 250 ms requests for a while after
# they stop, longer than these tests' 15 s of warm-up and window (seen: a v2 canary whose steps
# took 3 ms judged at 266 ms in the next test). The defaults, 30 s and 60 s, are meant to outlast
# it.
def test_a_slow_release_is_rolled_back_by_itself_and_the_incident_reads_in_order(
    serving_v1: NodePool,
    traffic: None,
    trio: tuple[Devfleet, FleetState],
    client: Client,
    settings: object,
) -> None:
    began = timezone.now()
    # v3's reranker sleeps 250 ms on every batch: no request through it can meet this budget.
    model_set_budget(model_name="rag_pipeline", latency_budget_ms=250, actor="release-manager")
    rollout = start(serving_v1, 3, "1 node, hold 60s\n100%", failure_limit=1)
    rollout = until_state(rollout, State.ROLLED_BACK, State.SUCCEEDED, State.PAUSED)
    assert rollout.state == State.ROLLED_BACK, rollout.reason
    failing = rollout.measurements.get(metric="p99", verdict="failure")
    assert failing.canary_value and failing.threshold
    assert failing.canary_value > failing.threshold
    assert rollout.rollback_duration is not None
    print(f"\nfirst failing measurement -> canary node on v1 only: {rollout.rollback_duration}")
    for node in serving_v1.nodes.all():
        assert {v for m, v in ready_on(node) if m == "rag_pipeline"} == {1}

    # The rest of the incident: a manual load on one node, a node killed and restarted.
    devfleet, _ = trio
    deployment_set(
        model_name="embedder",
        version=2,
        node=Node.objects.get(name="trio-2"),
        actor="operator-user",
    )
    devfleet.kill("trio-3")
    wait_for("trio-3 is down", AuditEvent.objects.filter(action="node.down").exists, 60)
    devfleet.restart("trio-3")
    wait_for("trio-3 is back", AuditEvent.objects.filter(action="node.up").exists, 60)

    client.force_login(make_user(Role.VIEWER))
    until = timezone.now() + timedelta(seconds=1)  # the window is written to the second
    window = {"start": f"{began:%Y-%m-%dT%H:%M:%S}", "end": f"{until:%Y-%m-%dT%H:%M:%S}"}
    page = client.get("/audit/timeline/", {**window, "model": "rag_pipeline"}).content.decode()
    story = [
        ("rollout.start", "release-manager"),
        ("rollout.step", "system:rollouts"),
        ("rollout.aborting", "system:rollouts"),
        ("rollout.rolled_back", "system:rollouts"),
        ("deployment.set", "operator-user"),
        ("node.down", "system:poller"),
        ("node.up", "system:poller"),
    ]
    position = page.index('id="events"')
    for action, actor in story:  # each found after the one before: in the order they happened
        found = re.compile(rf"<strong>{action}</strong>[^<]*<span class=\"muted\">by {actor}<")
        match = found.search(page, position)
        assert match, f"{action} by {actor} is missing or out of order"
        position = match.end()
    # A chart per model and node the window touched, the model asked for first.
    charts = re.findall(r'hx-get="(/audit/timeline/chart/[^"]+)"', page)
    subjects = [re.search(r"(model|node)=([\w-]+)", unescape(url)).groups() for url in charts]  # type: ignore[union-attr]
    assert subjects[0] == ("model", "rag_pipeline")
    assert {("model", "embedder"), ("node", "trio-2"), ("node", "trio-3")} <= set(subjects)
    for url, subject, expected in [
        (charts[0], "rag_pipeline", {"aborting rag_pipeline v3", "rolled_back rag_pipeline v3"}),
        (charts[subjects.index(("node", "trio-3"))], "trio-3", {"down trio-3", "up trio-3"}),
    ]:
        chart = client.get(unescape(url), headers={"HX-Request": "true"}).content.decode()
        assert f"P99 latency: {'model' if subject == 'rag_pipeline' else 'node'} {subject}" in chart
        figure = json.loads(re.search(r'json" id="[\w-]+">(.*?)</script>', chart, re.S)[1])  # type: ignore[index]
        # Every marker's story is on hover, however crowded its label: each starts with it.
        hovers = [
            t for trace in figure["data"] if trace["name"] == "changes" for t in trace["text"]
        ]
        assert all(any(t.startswith(e) for t in hovers) for e in expected), (subject, hovers)
    report = client.get("/audit/timeline/report.md", window).content.decode()
    for action, actor in story:
        assert f"| {actor} | `{action}` |" in report
