"""The automation that steps a pool down its tiers on its own: when the pipeline breaks its
budget in both windows with enough requests, one tier at once, audited as the system with its
evidence; never on one window, too few requests or missing data; never while a pin or a rollout
owns the pool; and frozen, with an incident, when it would switch too often. Prometheus is
stubbed at its client (tests/integration has real ones)."""

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.degradation import automation
from apps.degradation.models import Tiers
from apps.degradation.probes import Probed
from apps.degradation.services import tier_confirm, tier_pin, tier_unpin, tiers_set
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.incidents.models import Incident
from apps.prometheus.catalog import budget_queries
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.services import model_set_budget, model_set_slo
from apps.rollouts.models import Notification
from apps.rollouts.proposals import rollout_start
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = pytest.mark.django_db
PIPELINE = "rag_pipeline"
# window: (P99 ms, ok, failed), then (rejected, queue us, compute us, the queue ratio's median
# slice: by default queue over compute) where a test has them
Figures = dict[int, tuple[float | None, ...]]


@pytest.fixture
def pool(settings: object) -> NodePool:
    """Pool demo serving rag_pipeline v1 with tiers v1 > v4 > v5, a 3 s budget and a 99.9 %
    availability objective; windows of 30 s and 120 s, 20 requests at least."""
    settings.DEGRADATION_SHORT_S, settings.DEGRADATION_LONG_S = 30, 120  # type: ignore[attr-defined]
    settings.DEGRADATION_MIN_REQUESTS = 20  # type: ignore[attr-defined]
    settings.DEGRADATION_MAX_SWITCHES_PER_HOUR = 2  # type: ignore[attr-defined]
    import_demo()
    pool = NodePool.objects.create(name="demo")
    Node.objects.create(name="demo-1", pool=pool, http_url="http://127.0.0.1:1")
    model_set_budget(model_name=PIPELINE, latency_budget_ms=3000, actor="sre")
    model_set_slo(model_name=PIPELINE, availability=0.999, latency=None, actor="sre")
    deployment_set(model_name=PIPELINE, version=1, pool=pool, actor="system:test")
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4, 5], actor="rm")
    return pool


@pytest.fixture
def prometheus(monkeypatch: pytest.MonkeyPatch) -> Callable[[Figures], None]:
    """Answers the automation's queries with the figures given per window."""

    def answering(figures: Figures) -> None:
        def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
            window = next(w for w in figures if f"[{w}s]" in query or f"[{w}s:" in query)
            p99, ok, failed, rejected, queue, compute, held = (*figures[window], *[None] * 4)[:7]
            if held is None and queue is not None and compute:
                held = queue / compute
            value = (
                held
                if "quantile_over_time" in query
                else rejected
                if "REJECTED" in query
                else queue
                if "queue_duration" in query
                else compute
                if "compute_infer" in query
                else p99
                if "summary" in query
                else failed
                if "failure" in query
                else ok
            )
            return [] if value is None else [({}, value)]

        monkeypatch.setattr(automation, "instant_query", instant_query)

    return answering


def serving(pool: NodePool) -> int:
    return Deployment.objects.get(pool=pool, model__name=PIPELINE).version


def tick() -> str:
    return automation.tiers_tick(tiers_id=Tiers.objects.get().pk)


SLOW = {30: (3500.0, 100.0, 0.0), 120: (3200.0, 400.0, 0.0)}
FINE = {30: (800.0, 100.0, 0.0), 120: (900.0, 400.0, 0.0)}


def test_a_breach_in_both_windows_steps_down_one_tier_at_once(
    pool: NodePool, prometheus: Callable[[Figures], None]
) -> None:
    prometheus(FINE)
    assert tick() == "rag_pipeline on demo: within budget: P99 800 ms over 30 s, 900 ms over 120 s"
    prometheus(SLOW)
    evidence = "P99 3500 ms over 30 s and 3200 ms over 120 s, budget 3000 ms"
    assert tick() == f"rag_pipeline on demo: v1 → v4: {evidence}"
    # v4 served; v1 stays READY beside it, for probes and a switch back that only narrows; the
    # steps of v5, the tier below, load beside, unserved: the next switch down loads nothing.
    found = Deployment.objects.get(pool=pool)
    assert (found.version, found.baseline_version, found.standby_version) == (4, 1, 5)
    event = AuditEvent.objects.get(action="pool.degrade")
    incident = Incident.objects.get()  # the switch opened one: a person is told
    assert (event.actor, event.message, event.before, event.outcome) == (
        "system:degradation",
        evidence,
        {"version": 1, "tier": 0},
        {"version": 4, "tier": 1, "incident": incident.pk},
    )
    parts = [part["action"] for part in event.parts]
    assert parts == ["deployment.set", "incident.open", "incident.update"]
    assert (incident.pool.name, incident.model.name, incident.severity) == (
        "demo",
        PIPELINE,
        "warning",
    )
    assert f"system:degradation stepped down v1 → v4: {evidence}" in incident.notes
    # Triton's P99 summaries still hold v1's requests for a while: no chasing them further down.
    assert tick().endswith(
        "the readings still hold requests from before the last step down or "
        "probes: nothing is decided"
    )
    assert serving(pool) == 4
    Tiers.objects.update(judged_from=timezone.now())
    tick()
    assert serving(pool) == 5  # settled, and the budget still broken: one tier further
    Tiers.objects.update(judged_from=timezone.now())
    assert tick() == f"rag_pipeline on demo: at its lowest tier, v5: {evidence}"
    (incident,) = Incident.objects.all()  # the second switch was told in the same incident
    assert incident.notes.count("stepped down") == 2


def test_errors_over_the_objective_in_both_windows_step_down_too(
    pool: NodePool, prometheus: Callable[[Figures], None]
) -> None:
    prometheus({30: (800.0, 95.0, 5.0), 120: (900.0, 390.0, 10.0)})
    assert "errors 5.00% over 30 s and 2.50% over 120 s, objective at most 0.10%" in tick()
    assert serving(pool) == 4


@pytest.mark.parametrize(
    ("figures", "said"),
    [
        ({30: (3500.0, 100.0, 0.0), 120: (2500.0, 400.0, 0.0)}, "within budget"),  # one window
        ({30: (2500.0, 100.0, 0.0), 120: (3500.0, 400.0, 0.0)}, "within budget"),
        ({30: (3500.0, 10.0, 0.0), 120: (3200.0, 400.0, 0.0)}, "10 requests over 30 s, 20 needed"),
        ({30: (None, 100.0, 0.0), 120: (3200.0, 400.0, 0.0)}, "no data over 30 s"),
    ],
)
def test_one_window_too_few_requests_or_no_data_decide_nothing(
    pool: NodePool, prometheus: Callable[[Figures], None], figures: Figures, said: str
) -> None:
    prometheus(figures)
    assert said in tick()
    assert serving(pool) == 1 and not AuditEvent.objects.filter(action="pool.degrade").exists()


@pytest.mark.parametrize(
    ("figures", "said"),
    [
        (
            {30: (800.0, 100.0, 0.0, 0.0, 5e6, 1e6), 120: (900.0, 400.0, 0.0, 0.0, 9e6, 2e6)},
            "queues 5.0x compute over 30 s and 4.5x for most of 120 s, at most 4x",
        ),
        (
            {30: (800.0, 100.0, 0.0, 3.0), 120: (900.0, 400.0, 0.0, 7.0)},
            "3 requests rejected over 30 s and 7 over 120 s: a queue is full",
        ),
    ],
)
def test_a_saturated_pipeline_in_both_windows_steps_down_too(
    pool: NodePool, prometheus: Callable[[Figures], None], figures: Figures, said: str
) -> None:
    prometheus(figures)
    assert said in tick()
    assert serving(pool) == 4
    queries = budget_queries(
        model=PIPELINE, steps=["embedder"], pool="d", nodes=["d-1"], window_s=9
    ).values()
    assert 'model=~"embedder|rag_pipeline"' in " ".join(queries)  # its steps' queues are its own


@pytest.mark.parametrize(
    ("ttft", "tier"), [({30: 1600.0, 120: 1200.0}, 4), ({30: 1600.0, 120: 700.0}, 1)]
)
def test_an_llm_steps_first_token_over_its_objective_in_both_windows_steps_down(
    pool: NodePool, monkeypatch: pytest.MonkeyPatch, ttft: dict[int, float], tier: int
) -> None:
    """Whole requests within budget, but the generator's first tokens (its P99 per window, from
    whichever backend) over its objective of 800 ms."""
    model_set_slo(
        model_name="generator", availability=None, latency=None, ttft=(0.99, 800), actor="sre"
    )

    def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
        window = next(w for w in ttft if f"[{w}s]" in query or f"[{w}s:" in query)
        if "first_token" in query:
            return [({"model": "generator"}, ttft[window])]
        if "summary" in query:
            return [({}, 800.0)]
        return [({}, 100.0)] if "success" in query else []

    monkeypatch.setattr(automation, "instant_query", instant_query)
    said = tick()
    assert serving(pool) == tier
    if tier == 4:
        assert said.endswith(
            "v1 → v4: generator's first token P99 1600 ms over 30 s and 1200 ms over 120 s, "
            "objective 800 ms"
        )


def test_saturation_in_one_window_decides_nothing(
    pool: NodePool, prometheus: Callable[[Figures], None]
) -> None:
    prometheus({30: (800.0, 100.0, 0.0, 2.0, 5e6, 1e6), 120: (900.0, 400.0, 0.0, 0.0, 1e6, 2e6)})
    assert "within budget" in tick() and serving(pool) == 1


def test_a_burst_of_seconds_is_no_saturation_over_the_long_window(
    pool: NodePool, prometheus: Callable[[Figures], None]
) -> None:
    """A 7-second burst fills queues enough that the long window's sums read 4.5x as well; its
    median 10 s slice reads 0.5x: the long view held."""
    long = (900.0, 400.0, 0.0, 0.0, 9e6, 2e6, 0.5)
    prometheus({30: (800.0, 100.0, 0.0, 0.0, 5e6, 1e6), 120: long})
    assert "within budget" in tick() and serving(pool) == 1
    queries = budget_queries(model=PIPELINE, steps=[], pool="d", nodes=["d-1"], window_s=120)
    assert queries["queue_held"].startswith("quantile_over_time(0.5, (sum(increase(")
    assert queries["queue_held"].endswith("[10s])))[120s:10s])")


def test_prometheus_away_decides_nothing_and_says_so(
    pool: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def away(query: str) -> list[tuple[dict[str, str], float]]:
        raise PrometheusUnavailable("Prometheus at http://127.0.0.1:1 did not answer")

    monkeypatch.setattr(automation, "instant_query", away)
    assert tick() == "rag_pipeline on demo: Prometheus at http://127.0.0.1:1 did not answer"
    assert serving(pool) == 1


def test_a_pin_or_a_running_rollout_holds_the_automation(
    pool: NodePool, prometheus: Callable[[Figures], None]
) -> None:
    prometheus(SLOW)
    tier_pin(pool_name="demo", model_name=PIPELINE, tier=0, reason="hold", hours=1, actor="oncall")
    assert tick() == "rag_pipeline on demo: pinned by oncall"
    tier_unpin(pool_name="demo", model_name=PIPELINE, actor="oncall")
    rollout_start(
        model_name=PIPELINE,
        pool_name="demo",
        canary_version=2,
        plan="50%\n100%",
        analysis=None,
        actor="system:test",
    )
    assert "abort it, or roll the pool back" in tick()
    assert serving(pool) == 1


def test_switching_too_often_freezes_it_and_opens_an_incident(
    pool: NodePool, prometheus: Callable[[Figures], None], settings: object
) -> None:
    """A flapping fault: each time a person puts the primary back, the budget breaks again."""
    settings.ROLLOUT_WEBHOOK_URL = "http://127.0.0.1:1/hook"  # type: ignore[attr-defined]
    prometheus(SLOW)
    for _ in range(2):
        tick()
        assert serving(pool) == 4
        deployment_set(model_name=PIPELINE, version=1, pool=pool, actor="system:test")
        Tiers.objects.update(judged_from=None)  # the readings settled since
    said = tick()
    assert said.startswith("rag_pipeline on demo: frozen: 2 switches in the last hour")
    assert serving(pool) == 1  # frozen: a person decides now
    assert AuditEvent.objects.filter(action="pool.degrade").count() == 2
    frozen = AuditEvent.objects.get(action="pool.freeze_tiers")
    assert (
        frozen.actor == "system:degradation"
        and "and another one due: P99 3500 ms" in frozen.message
    )
    incident = Incident.objects.get()  # the switches' incident, raised to critical
    assert (incident.severity, incident.notes.count("stepped down")) == ("critical", 2)
    assert "froze: 2 switches in the last hour" in incident.notes
    told = Notification.objects.order_by("id")  # each switch and the freeze, by webhook too
    assert [n.event for n in told] == ["degraded", "degraded", "frozen"]
    assert told[0].rollout is None and told[0].payload["pool"]["url"].endswith("/pools/demo/tiers/")
    assert told[0].payload["text"].startswith("rag_pipeline on demo stepped down v1 → v4: P99")
    assert tick().startswith("rag_pipeline on demo: frozen since")
    tiers_set(pool_name="demo", model_name=PIPELINE, versions=[1, 4, 5], actor="rm")
    assert Tiers.objects.get().frozen_at is None  # set again by a person: it starts afresh
    lifted = AuditEvent.objects.filter(action="pool.set_tiers").latest("id")
    assert (lifted.actor, lifted.after["versions"]) == ("rm", [1, 4, 5])
    assert "2 switches in the last hour" in lifted.before["frozen"]
    Tiers.objects.update(switched_at=[timezone.now().isoformat()])
    tick()
    assert serving(pool) == 4


def test_back_up_a_tier_only_after_the_dwell_and_the_probes_of_the_tier_above(
    pool: NodePool, prometheus: Callable[[Figures], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes are stubbed here (they go to Triton: tests/integration sends real ones)."""
    probed: list[int] = []
    answer = {"with": Probed(False, "probes of v1: P99 3400 ms, over the budget of 3000 ms")}
    monkeypatch.setattr(automation, "probe", lambda tiers, v: probed.append(v) or answer["with"])

    def dwell_passes() -> None:
        past = timezone.now() - timedelta(seconds=601)
        Deployment.objects.update(updated_at=past)
        Tiers.objects.update(breached_at=past, probed_at=None)

    prometheus(SLOW)
    tick()
    prometheus(FINE)
    assert "v1 is probed from" in tick() and probed == []  # the budget has not held 600 s yet
    dwell_passes()
    prometheus({30: (None, 0.0, 0.0), 120: (None, 0.0, 0.0)})
    assert "no data over 30 s: nothing is decided" in tick() and probed == []  # no evidence
    prometheus(FINE)
    assert tick().endswith("; stays: probes of v1: P99 3400 ms, over the budget of 3000 ms")
    assert probed == [1] and serving(pool) == 4
    assert "probed v1 at" in tick() and probed == [1]  # one round of probes a dwell
    Tiers.objects.update(breached_at=timezone.now())
    Tiers.objects.update(probed_at=None)
    assert "v1 is probed from" in tick()  # broken again at v4 meanwhile: the dwell starts over

    dwell_passes()
    answer["with"] = Probed(True, "probes of v1: P99 900 ms over 60 requests, budget 3000 ms")
    assert tick() == f"rag_pipeline on demo: v4 → v1: {answer['with'].evidence}"
    found = Deployment.objects.get(pool=pool)
    assert (found.version, found.baseline_version, found.standby_version) == (1, None, 4)
    event = AuditEvent.objects.get(action="pool.restore")
    incident = Incident.objects.get()  # the step down's, told of the way back
    assert (event.actor, event.message, event.before, event.outcome) == (
        "system:degradation",
        answer["with"].evidence,
        {"version": 4, "tier": 1},
        {"version": 1, "tier": 0, "incident": incident.pk},
    )
    assert "stepped back up v4 → v1: probes of v1: P99 900 ms" in incident.notes
    assert Tiers.objects.get().probed == answer["with"].evidence  # the page shows it
    prometheus(SLOW)
    assert tick().startswith("rag_pipeline on demo: frozen: 2 switches in the last hour")


def test_on_a_protected_pool_a_person_confirms_each_switch_back(
    pool: NodePool, prometheus: Callable[[Figures], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cleared = Probed(True, "probes of v1: P99 900 ms over 60 requests, budget 3000 ms")
    monkeypatch.setattr(automation, "probe", lambda tiers, version: cleared)
    prometheus(SLOW)
    tick()  # stepping down never waits: it protects the users
    NodePool.objects.filter(pk=pool.pk).update(protected=True)
    past = timezone.now() - timedelta(seconds=601)
    Deployment.objects.update(updated_at=past)
    Tiers.objects.update(breached_at=past)
    prometheus(FINE)
    waiting = f"{cleared.evidence}: a person confirms the switch back (protected pool)"
    assert tick().endswith(waiting) and serving(pool) == 4
    assert tick().endswith(waiting)  # and it keeps saying so
    tier_confirm(pool_name="demo", model_name=PIPELINE, actor=make_user(Role.OPERATOR))
    assert serving(pool) == 1
    event = AuditEvent.objects.get(action="pool.confirm_restore")
    assert (event.actor, event.message, event.before, event.outcome) == (
        "operator-user",
        cleared.evidence,
        {"version": 4},
        {"version": 1, "tier": 0},
    )
    assert not AuditEvent.objects.filter(action="pool.restore").exists()
    assert Tiers.objects.get().cleared is None


def test_two_ticks_judging_the_same_breach_switch_once(pool: NodePool) -> None:
    """A tick slower than the period overlaps the next: both read v1 served and a breach; the
    one that waited on the row's lock finds v4 served, and neither switches nor counts again."""
    tiers = Tiers.objects.get()
    first = automation._switch(tiers.pk, 1, 1, "breach")
    second = automation._switch(tiers.pk, 1, 1, "breach")  # decided on the same reading of v1
    assert first == "rag_pipeline on demo: v1 → v4: breach"
    assert second == "rag_pipeline on demo: serves v4 already"
    assert AuditEvent.objects.filter(action="pool.degrade").count() == 1
    assert len(Tiers.objects.get().switched_at) == 1
