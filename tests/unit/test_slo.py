"""The SLO burn-rate gate: the arithmetic on known values, the gate's verdicts, a model's
objectives, and one round of analysis with Prometheus stubbed at its module boundary."""

import math

import pytest
from django.core.management import CommandError, call_command

from apps.audit.models import AuditEvent
from apps.registry.models import Model
from apps.registry.services import RegistryError, model_set_slo
from apps.rollouts import analysis
from apps.rollouts.plans import Analysis, PlanError
from apps.rollouts.slo import Objectives, burn_rate, gate, over_budget

# Triton's summary quantiles, in us.
SUMMARY = {0.5: 10_000.0, 0.9: 20_000.0, 0.95: 30_000.0, 0.99: 50_000.0, 0.999: 90_000.0}


@pytest.mark.parametrize(
    ("budget", "share"),
    [
        (100_000, 0.0),  # above the highest quantile
        (90_000, 0.0),
        (50_000, 0.01),  # exactly the P99
        (70_000, 0.0055),  # half-way between P99 and P99.9
        (25_000, 0.075),  # half-way between P90 and P95
        (10_000, 0.5),
        (5_000, 0.75),  # below the median: from the origin
    ],
)
def test_the_share_over_budget_is_interpolated_between_quantiles(budget: int, share: float) -> None:
    assert over_budget(SUMMARY, budget) == pytest.approx(share)


def test_a_summary_without_values_gives_no_share() -> None:
    assert over_budget({}, 1000) is None
    assert over_budget({0.5: math.nan, 0.99: math.nan}, 1000) is None
    assert over_budget({0.5: math.nan, 0.99: 2000.0}, 1000) == pytest.approx(0.505)
    assert over_budget({0.5: 0.0, 0.99: 0.0}, 1000) == 0.0
    assert over_budget({0.5: 0.0, 0.99: 10.0}, 0) == pytest.approx(0.5)  # at the median


def test_the_burn_rate_is_the_bad_share_over_the_error_budget() -> None:
    assert burn_rate(0.2, 0.999) == pytest.approx(200)
    assert burn_rate(0.001, 0.999) == pytest.approx(1)
    assert burn_rate(0.0, 0.99) == 0.0
    assert burn_rate(None, 0.99) is None


def test_the_gate_fails_only_when_both_windows_burn_too_fast() -> None:
    assert gate({15: 200.0, 60: 180.0}, 14.4, 0.999, "availability").verdict == "failure"
    assert gate({15: 1.0, 60: 2.0}, 14.4, 0.999, "availability").verdict == "success"
    blip = gate({15: 1.0, 60: 20.0}, 14.4, 0.999, "availability")
    assert blip.verdict == "marginal" and "over the 60 s window only" in blip.detail
    failed = gate({15: 200.0, 60: 180.0}, 14.4, 0.999, "availability")
    assert failed.detail == (
        "availability burn rate 200x over 15 s and 180x over 60 s (limit 14.4x, objective 0.999)"
    )
    missing = gate({15: None, 60: 2.0}, 14.4, 0.999, "latency")
    assert (missing.verdict, missing.detail) == ("inconclusive", "no latency data over 15 s")


def test_analysis_names_a_bad_short_window() -> None:
    with pytest.raises(PlanError, match="slo_short_s"):
        Analysis.from_dict({"slo_short_s": 0})
    with pytest.raises(PlanError, match="slo_burn_limit"):
        Analysis.from_dict({"slo_burn_limit": 0.5})


@pytest.mark.django_db
def test_objectives_are_checked_audited_and_read_back() -> None:
    Model.objects.create(name="rag", latency_budget_ms=300)
    Model.objects.create(name="plain")
    model_set_slo(model_name="rag", availability=0.999, latency=0.99, actor="sre")
    rag = Model.objects.get(name="rag")
    assert rag.slo == "99.9% of requests succeed, 99% within 300 ms"
    assert Objectives.of(rag) == Objectives(0.999, 0.99, 300)
    event = AuditEvent.objects.get(action="model.set_slo")
    assert event.after == {"slo_availability": 0.999, "slo_latency": 0.99}
    assert Objectives.of(Model.objects.get(name="plain")) is None
    with pytest.raises(RegistryError, match=r"slo_availability.*1.5 is not a share"):
        model_set_slo(model_name="rag", availability=1.5, latency=None, actor="sre")
    with pytest.raises(RegistryError, match="needs a latency budget"):
        model_set_slo(model_name="plain", availability=None, latency=0.99, actor="sre")
    with pytest.raises(CommandError, match="no model named 'nope'"):
        call_command("set_slo", "nope", "--availability", "0.99")
    call_command("set_slo", "plain", "--availability", "0.95")
    assert Model.objects.get(name="plain").slo == "95% of requests succeed"


def test_a_canary_that_burns_its_budget_fails_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Canary node a fails 20 % of its requests and answers 2 % of them over budget, nodes b and
    c fail none and are fast: the canary burns 200x its availability budget and 2x its latency
    budget; the others nothing."""

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        if "nv_inference_request_success" in query and "duration" not in query:
            return [({"node": "a"}, 80.0), ({"node": "b"}, 100.0), ({"node": "c"}, 100.0)]
        if "nv_inference_request_failure" in query:
            return [({"node": "a"}, 20.0), ({"node": "b"}, 0.0)]
        if "quantile" in query and "avg_over_time(nv_inference_request_summary_us{" in query:
            canary = {0.5: 10_000.0, 0.9: 20_000.0, 0.95: 30_000.0, 0.99: 50_000.0, 0.999: 90e3}
            other = {q: v / 10 for q, v in canary.items()}
            return [
                ({"node": node, "quantile": str(q)}, v)
                for node, quantiles in [("a", canary), ("b", other), ("c", other)]
                for q, v in quantiles.items()
            ]
        return [({"node": n}, 10.0) for n in ("a", "b", "c")]  # the P99s

    monkeypatch.setattr(analysis, "instant_query", answer)
    results = analysis.measure(
        model="rag",
        pool="gpu",
        canary_nodes=["a"],
        spec=Analysis(judge="threshold", window_s=60, slo_short_s=15, min_requests=20),
        budget_ms=None,
        steps=[],
        slo=Objectives(availability=0.999, latency=0.99, budget_ms=30),
    )
    found = {r.metric: r for r in results}
    errors, latency = found["availability burn rate"], found["latency burn rate"]
    assert (errors.canary, errors.baseline, errors.threshold) == (
        pytest.approx(200),
        0.0,
        14.4,
    )
    assert errors.verdict == "failure" and "over 15 s and" in errors.detail
    assert (latency.canary, latency.baseline) == (pytest.approx(5), 0.0)  # 5 % over 30 ms
    assert latency.verdict == "success"  # 5x is within the limit of 14.4x
    assert analysis.overall(results) == "failure"
    assert "over 15 s and 60 s" in errors.query


def test_without_enough_requests_the_gate_does_not_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(analysis, "instant_query", lambda query: [])
    results = analysis.measure(
        model="rag",
        pool="gpu",
        canary_nodes=["a"],
        spec=Analysis(),
        budget_ms=None,
        steps=[],
        compare=False,
        slo=Objectives(availability=0.999, latency=None, budget_ms=None),
    )
    found = {r.metric: r for r in results}
    assert "latency burn rate" not in found
    assert found["availability burn rate"].verdict == "inconclusive"


def test_the_share_of_first_tokens_over_a_threshold_is_read_from_buckets() -> None:
    from apps.rollouts.slo import over_threshold

    buckets = {100.0: 0.0, 500.0: 10.0, 2000.0: 10.0, math.inf: 10.0}
    assert over_threshold(buckets, 300) == pytest.approx(0.5)  # linear in (100, 500]
    assert over_threshold(buckets, 500) == 0.0
    assert over_threshold(buckets, 5000) == 0.0
    assert over_threshold({100.0: 2.0, math.inf: 10.0}, 200) == pytest.approx(0.8)  # past it
    assert over_threshold({math.inf: 0.0}, 800) is None  # no first token: no share


def test_an_llms_first_token_objective_gates_the_canary_on_its_burn_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary node a's first tokens all between 500 and 2,000 ms, the others' under 500 ms,
    in Triton's histogram; the objective 99 % within 800 ms."""

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        if "vllm:" in query:
            return []
        if "first_response_histogram_ms_bucket" in query:
            slow = {"100": 0.0, "500": 0.0, "2000": 10.0, "+Inf": 10.0}
            fast = {"100": 0.0, "500": 10.0, "2000": 10.0, "+Inf": 10.0}
            return [
                ({"node": node, "le": le}, value)
                for node, bins in [("a", slow), ("b", fast), ("c", fast)]
                for le, value in bins.items()
            ]
        if "nv_inference_request_failure" in query:
            return []
        return [({"node": n}, 100.0) for n in ("a", "b", "c")]

    monkeypatch.setattr(analysis, "instant_query", answer)
    results = analysis.measure(
        model="generator",
        pool="gpu",
        canary_nodes=["a"],
        spec=Analysis(judge="threshold", window_s=60, slo_short_s=15, min_requests=20),
        budget_ms=None,
        steps=[],
        slo=Objectives(availability=None, latency=None, budget_ms=None, ttft=0.99, ttft_ms=800),
    )
    found = {r.metric: r for r in results}["first token burn rate"]
    # 80 % of the canary's first tokens over 800 ms: 80 times the 1 % the objective allows.
    assert (found.canary, found.baseline, found.verdict) == (pytest.approx(80), 0.0, "failure")
    assert "first token burn rate 80x over 15 s and 80x over 60 s" in found.detail
    assert "the share of first tokens above 800 ms" in found.query
