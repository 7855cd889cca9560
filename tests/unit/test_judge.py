"""The statistical judge on known samples: what each verdict means, and the edge cases."""

import math

import pytest

from apps.rollouts.judge import compare, compare_within, score
from apps.rollouts.plans import Analysis, PlanError
from apps.rollouts.verdicts import Verdict

BASELINE = [100.0, 102, 98, 101, 99, 103, 97, 100, 101, 99]


def latency(canary: list[float], baseline: list[float] = BASELINE, **kwargs: float) -> object:
    return compare(
        canary,
        baseline,
        confidence=kwargs.get("confidence", 0.95),
        tolerance=kwargs.get("tolerance", 0.1),
        relative=True,
    )


def test_a_known_ordering_has_its_exact_p_value() -> None:
    found = compare([4.0, 5, 6], [1.0, 2, 3], confidence=0.9, tolerance=0.5, relative=True)
    assert (found.u, found.p) == (9.0, pytest.approx(0.05))  # 1 of the 20 orderings
    assert found.effect == pytest.approx(5 / 2 - 1)
    assert found.verdict == Verdict.FAILURE


def test_a_much_slower_canary_fails_and_says_by_how_much() -> None:
    found = latency([x * 2 for x in BASELINE])
    assert found.verdict == Verdict.FAILURE
    assert found.p is not None and found.p < 0.001
    assert "canary +100.0% against the baseline (tolerance 0.1)" in found.detail


def test_the_same_distribution_passes() -> None:
    found = latency([101.0, 99, 100, 102, 98, 100, 103, 97, 99, 101])
    assert (found.verdict, found.detail) == (Verdict.SUCCESS, "")


def test_a_faster_canary_passes_only_worse_counts() -> None:
    assert latency([x / 2 for x in BASELINE]).verdict == Verdict.SUCCESS


def test_slightly_slower_for_sure_is_marginal_not_a_failure() -> None:
    """5 % slower on every sample: significant, but within the 10 % tolerance."""
    assert latency([x * 1.05 for x in BASELINE]).verdict == Verdict.MARGINAL


def test_much_slower_but_unproven_is_marginal() -> None:
    """Three noisy samples, one of them slow: a big effect, nothing significant."""
    found = latency([90.0, 300, 140], baseline=[100.0, 120, 95, 250])
    assert found.p is not None and found.p > 0.05
    assert found.verdict == Verdict.MARGINAL


@pytest.mark.parametrize(
    ("canary", "baseline"),
    [([], []), ([1.0, 2, 3], []), ([], [1.0, 2, 3]), ([1.0, 2], [1.0, 2, 3])],
)
def test_too_few_samples_on_a_side_is_inconclusive(
    canary: list[float], baseline: list[float]
) -> None:
    found = latency(canary, baseline)
    assert found.verdict == Verdict.INCONCLUSIVE and found.p is None
    assert "3 a side are needed" in found.detail


def test_not_a_number_is_no_sample() -> None:
    found = latency([math.nan, 100.0, math.inf, 101.0, 99.0], baseline=[100.0, math.nan, 99, 101])
    assert found.canary == [100.0, 101.0, 99.0] and found.baseline == [100.0, 99, 101]
    assert found.verdict == Verdict.SUCCESS
    assert latency([math.nan, math.nan, 100.0]).verdict == Verdict.INCONCLUSIVE


def test_all_equal_cannot_be_told_apart() -> None:
    found = compare([0.0] * 5, [0.0] * 8, confidence=0.95, tolerance=0.01, relative=False)
    assert (found.verdict, found.u, found.p, found.effect) == (Verdict.SUCCESS, 20.0, 1.0, 0.0)


def test_ties_are_ranked_together() -> None:
    found = latency([100.0, 100, 100, 101], baseline=[100.0, 100, 100, 100])
    assert found.p is not None and 0.05 < found.p < 1 and found.verdict == Verdict.SUCCESS


def test_errors_are_judged_by_their_mean_difference() -> None:
    """Error ratios are mostly 0: a median says nothing; 5 % more errors on every sample fails."""
    baseline = [0.0] * 10
    found = compare([0.05] * 10, baseline, confidence=0.95, tolerance=0.01, relative=False)
    assert found.verdict == Verdict.FAILURE and found.effect == pytest.approx(0.05)
    one_error = compare(
        [0.0] * 9 + [0.05], baseline, confidence=0.95, tolerance=0.01, relative=False
    )
    assert (
        one_error.verdict == Verdict.SUCCESS
    )  # one interval with an error: neither proven nor large


def test_a_zero_baseline_median_makes_any_canary_latency_infinitely_worse() -> None:
    found = compare([1.0, 2, 3], [0.0, 0, 0], confidence=0.95, tolerance=0.1, relative=True)
    assert (found.effect, found.verdict) == (math.inf, Verdict.FAILURE)


def test_the_step_fails_on_any_failure_else_scores_the_share_that_passes() -> None:
    assert score([(Verdict.SUCCESS, 1.0), (Verdict.FAILURE, 1.0)], 0.75) == Verdict.FAILURE
    assert score([(Verdict.SUCCESS, 1.0), (Verdict.MARGINAL, 1.0)], 0.75) == Verdict.MARGINAL
    assert score([(Verdict.SUCCESS, 3.0), (Verdict.MARGINAL, 1.0)], 0.75) == Verdict.SUCCESS
    assert score([(Verdict.SUCCESS, 1.0), (Verdict.INCONCLUSIVE, 1.0)], 0.75) == Verdict.SUCCESS
    assert score([(Verdict.INCONCLUSIVE, 1.0)], 0.75) == Verdict.INCONCLUSIVE
    assert score([], 0.75) == Verdict.INCONCLUSIVE


def test_the_evidence_keeps_the_samples_and_the_test() -> None:
    evidence = latency([x * 2 for x in BASELINE]).evidence()
    assert evidence["canary"] == [x * 2 for x in BASELINE] and evidence["baseline"] == BASELINE
    assert set(evidence) == {"canary", "baseline", "u", "p", "effect", "verdict"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"judge": "bayesian"}, "analysis.judge: 'bayesian' is not one of"),
        ({"confidence": 1.5}, r"analysis.confidence: 1.5 is out of range"),
        ({"pass_score": 0}, r"analysis.pass_score: 0 is out of range"),
        ({"sample_s": 0}, r"analysis.sample_s: 0 is out of range"),
    ],
)
def test_bad_judge_settings_are_named(raw: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Analysis.from_dict(raw)
    spec = Analysis.from_dict({"judge": "statistical", "confidence": "0.99"})
    assert (spec.judge, spec.confidence) == ("statistical", 0.99)


def test_a_relative_effect_within_the_margin_is_noise() -> None:
    """+20 % of a 3 ms latency, on every sample: significant, but 0.6 ms is within the margin."""
    fast = [3.0, 3.1, 2.9, 3.0, 3.05, 2.95]
    found = compare(
        [x * 1.2 for x in fast], fast, confidence=0.95, tolerance=0.1, relative=True, margin=5
    )
    assert found.verdict == Verdict.MARGINAL
    assert "tolerance 0.1, margin 5" in found.detail
    slow = compare([x * 1.2 for x in fast], fast, confidence=0.95, tolerance=0.1, relative=True)
    assert slow.verdict == Verdict.FAILURE


# First tokens by prompt length: short prompts answer in about 100 ms, long ones in about 200.
SHORT, LONG = [98.0, 100.0, 101.0, 103.0], [197.0, 199.0, 201.0, 204.0]


def test_a_canary_that_got_longer_prompts_is_not_failed_for_it_within_buckets() -> None:
    later = [x + 1 for x in SHORT], [x + 1 for x in LONG]  # another sample of each
    canary = (SHORT[:1], LONG + later[1])  # mostly long prompts, as fast as the baseline's
    baseline = (SHORT + later[0], LONG[:1])  # mostly short ones
    pooled = compare(
        canary[0] + canary[1],
        baseline[0] + baseline[1],
        confidence=0.95,
        tolerance=0.2,
        relative=True,
    )
    assert pooled.verdict == Verdict.FAILURE  # what judging them together would say
    within = compare_within(
        [(canary[0], baseline[0]), (canary[1], baseline[1])], confidence=0.95, tolerance=0.2
    )
    assert within.verdict == Verdict.SUCCESS, within.detail
    assert within.effect == pytest.approx(0.0, abs=0.03)


def test_a_canary_twice_as_slow_in_every_bucket_fails_within_them() -> None:
    slow = ([2 * x for x in SHORT], [2 * x for x in LONG])
    found = compare_within(
        [(slow[0], SHORT), (slow[1], LONG)], confidence=0.95, tolerance=0.2, margin=5
    )
    assert found.verdict == Verdict.FAILURE
    assert found.effect == pytest.approx(1.0, abs=0.02) and found.p is not None and found.p < 0.01
    assert found.detail.startswith("canary +100.0% against the baseline within 2 buckets")


def test_buckets_with_a_side_missing_say_nothing_and_too_few_wait() -> None:
    found = compare_within([([100.0], SHORT), (LONG, [])], confidence=0.95, tolerance=0.2)
    assert found.verdict == Verdict.INCONCLUSIVE
    assert (
        found.detail == "1 canary and 4 baseline samples in the same buckets; 3 a side are needed"
    )
