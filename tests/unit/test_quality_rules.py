import json
import math
from typing import Any

import pytest

from apps.quality.rules import MISSING, RuleError, Score, needs_baseline, parse_rule, score

WHERE = "line 3: expect.SOURCE"


def judge(raw: dict[str, Any], output: Any, **baseline: Any) -> Score:
    return score(parse_rule(raw, where=WHERE), output, **baseline)


def refusal(raw: object) -> str:
    with pytest.raises(RuleError) as caught:
        parse_rule(raw, where=WHERE)
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: ")
    return message


def ranked(*ids: str) -> list[str]:
    return [json.dumps({"id": i, "score": 0.5}) for i in ids]


def test_parsing_fills_in_the_defaults_of_each_kind() -> None:
    assert parse_rule({"exact": "x"}, where=WHERE) == {"exact": "x"}
    assert parse_rule({"contains": "x"}, where=WHERE) == {"contains": "x", "ignore_case": False}
    assert parse_rule({"close_to": [1, 2], "rel": 0}, where=WHERE) == {
        "close_to": [1, 2],
        "rel": 0.0,
    }
    assert parse_rule({"top_k": ["a", "b"]}, where=WHERE) == {
        "top_k": ["a", "b"],
        "k": 2,
        "key": None,
        "min": 1.0,
    }
    assert parse_rule({"cosine": [1.0, 0.0]}, where=WHERE) == {"cosine": [1.0, 0.0], "min": 0.99}


def test_parsing_fills_in_the_defaults_of_agrees() -> None:
    assert parse_rule({"agrees": "exact"}, where=WHERE) == {"agrees": "exact"}
    assert parse_rule({"agrees": "top_k", "key": "id"}, where=WHERE) == {
        "agrees": "top_k",
        "k": 1,
        "key": "id",
        "min": 1.0,
    }
    assert parse_rule({"agrees": "cosine"}, where=WHERE) == {"agrees": "cosine", "min": 0.99}
    assert parse_rule({"agrees": "close_to"}, where=WHERE) == {"agrees": "close_to", "abs": 0.0}
    assert parse_rule({"agrees": "close_to", "rel": 0.1}, where=WHERE) == {
        "agrees": "close_to",
        "rel": 0.1,
    }


def test_numeric_top_k_ids_are_read_as_text() -> None:
    assert parse_rule({"top_k": [17, "b"]}, where=WHERE)["top_k"] == ["17", "b"]
    assert judge({"top_k": [17]}, [17, 4, 9]).passed is True


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"top_k": ["a"], "k": "3"}, '"k"'),
        ({"top_k": ["a"], "k": 0}, '"k"'),
        ({"top_k": ["a"], "k": True}, '"k"'),
        ({"top_k": ["a"], "min": 2}, '"min"'),
        ({"top_k": ["a"], "min": 0}, '"min"'),
        ({"top_k": ["a"], "key": 3}, '"key"'),
        ({"top_k": []}, '"top_k"'),
        ({"top_k": ["a", "a"]}, '"top_k"'),
        ({"top_k": "a"}, '"top_k"'),
        ({"cosine": [1.0], "min": 1.5}, '"min"'),
        ({"cosine": 1.0}, '"cosine"'),
        ({"cosine": []}, '"cosine"'),
        ({"close_to": "1.5", "abs": 0.1}, '"close_to"'),
        ({"close_to": [1, [2]], "abs": 0.1}, '"close_to"'),
        ({"close_to": [1, None], "abs": 0.1}, '"close_to"'),
        ({"close_to": 1, "abs": -0.1}, '"abs"'),
        ({"close_to": 1, "rel": "5%"}, '"rel"'),
        ({"close_to": 1}, '"abs" or "rel"'),
        ({"close_to": 1, "abs": 0.1, "rel": 0.1}, '"abs" or "rel"'),
        ({"contains": 3}, '"contains"'),
        ({"contains": "a", "ignore_case": "yes"}, '"ignore_case"'),
        ({"exact": 1, "ignore_case": True}, '"ignore_case"'),
        ({"top_k": ["a"], "abs": 0.1}, '"abs"'),
        ({"agrees": "contains"}, '"agrees"'),
        ({"agrees": "exact", "min": 0.5}, '"min"'),
        ({"agrees": "cosine", "k": 1}, '"k"'),
        ({"agrees": "top_k", "k": -1}, '"k"'),
        ({"exactly": 1}, '"exactly"'),
        ({"exact": 1, "contains": "1"}, '"exact" and "contains"'),
    ],
)
def test_a_bad_rule_is_refused_naming_the_key(raw: dict[str, Any], named: str) -> None:
    assert named in refusal(raw)


def test_a_rule_that_is_not_an_object_is_refused() -> None:
    assert "JSON object" in refusal(["exact", 1])
    assert "JSON object" in refusal("exact")


def test_an_empty_rule_says_which_kinds_there_are() -> None:
    assert '"exact", "contains", "close_to", "top_k", "cosine", "agrees"' in refusal({})


def test_exact_passes_on_an_equal_output() -> None:
    assert judge({"exact": ["a", "b"]}, ["a", "b"]) == Score(True, 1.0, "")
    assert judge({"exact": {"id": 1}}, {"id": 1.0}).passed is True


def test_exact_compares_a_scalar_with_the_element_of_a_one_element_output() -> None:
    assert judge({"exact": "faq:orders-track"}, ["faq:orders-track"]).passed is True
    assert judge({"exact": 3}, [3.0]).passed is True
    assert judge({"exact": 3}, 3).passed is True


def test_exact_fails_saying_what_was_expected_and_what_came() -> None:
    assert judge({"exact": "faq:orders-track"}, ["faq:returns"]) == Score(
        False, 0.0, 'expected "faq:orders-track", got ["faq:returns"]'
    )
    assert judge({"exact": "a"}, ["a", "a"]).passed is False
    assert judge({"exact": "1"}, [1]).passed is False


def test_a_long_output_is_truncated_in_the_detail() -> None:
    result = judge({"exact": "short"}, ["x" * 1000])
    assert result.passed is False
    assert len(result.detail) < 200
    assert result.detail.endswith("…")


def test_contains_finds_the_text_in_a_string_or_any_string_element() -> None:
    assert judge({"contains": "track"}, "orders-track").passed is True
    assert judge({"contains": "track"}, [3, "faq:orders-track"]) == Score(True, 1.0, "")


def test_contains_is_case_sensitive_unless_told_otherwise() -> None:
    assert judge({"contains": "Track"}, ["orders-track"]) == Score(
        False, 0.0, 'expected a text containing "Track", got ["orders-track"]'
    )
    assert judge({"contains": "Track", "ignore_case": True}, ["orders-TRACK"]).passed is True


def test_contains_fails_on_an_output_without_text() -> None:
    assert judge({"contains": "1"}, [1, 2]).passed is False


def test_close_to_passes_within_an_absolute_tolerance() -> None:
    result = judge({"close_to": [[1.0, 2.0], [3.0, 4.0]], "abs": 0.01}, [[1.0, 2.005], [3, 4]])
    assert result.passed is True
    assert result.value == pytest.approx(0.005)
    assert result.detail == ""


def test_close_to_fails_beyond_the_tolerance_with_the_worst_error() -> None:
    result = judge({"close_to": [1.0, 2.0], "abs": 0.01}, [1.0, 2.5])
    assert result.passed is False
    assert result.value == pytest.approx(0.5)
    assert "worst abs error 0.5" in result.detail


def test_close_to_with_a_relative_tolerance_scales_by_the_expected_value() -> None:
    assert judge({"close_to": [100.0, 1.0], "rel": 0.05}, [104.0, 1.04]).passed is True
    result = judge({"close_to": [100.0, 1.0], "rel": 0.05}, [104.0, 1.1])
    assert result.passed is False
    assert result.value == pytest.approx(0.1)


def test_close_to_a_relative_zero_allows_no_difference() -> None:
    assert judge({"close_to": [0.0], "rel": 0.5}, [0.0]).passed is True
    result = judge({"close_to": [0.0], "rel": 0.5}, [0.001])
    assert result.passed is False
    assert result.value is None  # infinite: scores are stored as JSON


def test_close_to_compares_a_scalar_with_a_one_element_output() -> None:
    assert judge({"close_to": 0.5, "abs": 0.01}, [0.501]).passed is True


def test_close_to_fails_on_a_shape_mismatch_naming_both_shapes() -> None:
    assert judge({"close_to": [1.0, 2.0, 3.0], "abs": 1}, [[1.0, 2.0, 3.0]]) == Score(
        False, None, "expected shape [3], got shape [1, 3]"
    )


def test_close_to_fails_on_nan_in_the_output() -> None:
    result = judge({"close_to": [1.0, 2.0], "abs": 100}, [1.0, math.nan])
    assert result == Score(False, None, "NaN or infinity in the output: [1.0, NaN]")


def test_close_to_fails_on_an_output_that_is_not_numbers() -> None:
    result = judge({"close_to": [1.0], "abs": 1}, ["1.0"])
    assert result.passed is False
    assert result.detail == 'expected numbers, got ["1.0"]'


def test_top_k_passes_when_every_id_is_in_the_first_k() -> None:
    assert judge({"top_k": ["b", "a"]}, ["a", "b", "c"]) == Score(True, 1.0, "")
    assert judge({"top_k": ["c"], "k": 3}, ["a", "b", "c"]).passed is True


def test_top_k_fails_with_the_share_found() -> None:
    result = judge({"top_k": ["a", "b", "c"]}, ["a", "x", "c", "b"])
    assert result.passed is False
    assert result.value == pytest.approx(2 / 3)
    assert result.detail == 'expected ["a", "b", "c"] in the first 3, got ["a", "x", "c"]'


def test_top_k_passes_at_its_minimum_share() -> None:
    assert judge({"top_k": ["a", "b", "c"], "min": 0.6}, ["a", "x", "c"]).passed is True


def test_top_k_divides_by_k_when_it_is_shorter_than_the_list() -> None:
    assert judge({"top_k": ["a", "b", "c"], "k": 2}, ["b", "a"]).value == 1.0
    assert judge({"top_k": ["a", "b", "c"], "k": 2}, ["b", "c"]).value == 0.5


def test_top_k_with_a_key_reads_ids_from_json_elements() -> None:
    rule = {"top_k": ["orders-track"], "k": 1, "key": "id"}
    assert judge(rule, ranked("orders-track", "returns")).passed is True
    assert judge(rule, ranked("returns", "orders-track")) == Score(
        False, 0.0, 'expected ["orders-track"] in the first 1, got ["returns"]'
    )
    assert judge(rule, [{"id": "orders-track"}]).passed is True


def test_top_k_counts_an_element_without_the_key_as_no_id() -> None:
    rule = {"top_k": ["a", "b"], "key": "id"}
    result = judge(rule, ["not json", json.dumps({"name": "b"}), *ranked("a", "b")])
    assert result.value == 0.0


def test_cosine_passes_for_vectors_pointing_the_same_way() -> None:
    result = judge({"cosine": [1.0, 2.0, 3.0]}, [2.0, 4.0, 6.0])
    assert result.passed is True
    assert result.value == pytest.approx(1.0)


def test_cosine_flattens_nested_lists() -> None:
    assert judge({"cosine": [[1.0, 0.0], [0.0, 1.0]]}, [1.0, 0.0, 0.0, 1.0]).passed is True


def test_cosine_fails_below_its_minimum() -> None:
    assert judge({"cosine": [1.0, 0.0], "min": 0.5}, [0.0, 1.0]) == Score(
        False, 0.0, "expected a cosine of at least 0.5, got 0.0000"
    )
    assert judge({"cosine": [1.0, 0.0], "min": -1}, [-1.0, 0.0]).passed is True


def test_cosine_fails_on_a_length_mismatch() -> None:
    assert judge({"cosine": [1.0, 0.0]}, [1.0, 0.0, 0.0]) == Score(
        False, None, "expected 2 values, got 3"
    )


def test_cosine_fails_on_a_zero_vector() -> None:
    assert judge({"cosine": [1.0, 0.0]}, [0.0, 0.0]).detail.startswith("the output is all zeros")
    result = judge({"cosine": [0.0, 0.0]}, [1.0, 0.0])
    assert result.passed is False
    assert result.detail.startswith("the expected vector is all zeros")


def test_cosine_fails_on_nan_in_the_output() -> None:
    result = judge({"cosine": [1.0, 0.0]}, [math.nan, 0.0])
    assert result.passed is False
    assert "NaN" in result.detail


@pytest.mark.parametrize(
    "raw",
    [
        {"exact": "a"},
        {"contains": "a"},
        {"close_to": 1, "abs": 1},
        {"top_k": ["a"]},
        {"cosine": [1.0]},
        {"agrees": "exact"},
    ],
)
def test_a_missing_output_fails_every_rule(raw: dict[str, Any]) -> None:
    assert judge(raw, None, baseline=["a"]) == Score(False, None, "no output")
    assert judge(raw, None) == Score(False, None, "no output")


def test_only_agrees_needs_a_baseline() -> None:
    assert needs_baseline(parse_rule({"agrees": "cosine"}, where=WHERE)) is True
    assert needs_baseline(parse_rule({"cosine": [1.0]}, where=WHERE)) is False


def test_agrees_without_a_baseline_does_not_apply() -> None:
    assert judge({"agrees": "exact"}, ["a"]) == Score(None, None, "no baseline to agree with")
    assert judge({"agrees": "exact"}, ["a"], baseline=MISSING).passed is None
    assert judge({"agrees": "exact"}, ["a"], baseline=None).passed is None


def test_agrees_exact_compares_with_the_baseline_output() -> None:
    assert judge({"agrees": "exact"}, ["a"], baseline=["a"]) == Score(True, 1.0, "")
    assert judge({"agrees": "exact"}, ["b"], baseline=["a"]) == Score(
        False, 0.0, 'expected ["a"], got ["b"]'
    )


def test_agrees_top_k_compares_the_first_ids_of_both() -> None:
    rule = {"agrees": "top_k", "key": "id"}
    assert judge(rule, ranked("a", "x"), baseline=ranked("a", "y")).passed is True
    assert judge(rule, ranked("x", "a"), baseline=ranked("a", "x")).passed is False
    wider = {"agrees": "top_k", "k": 2, "key": "id", "min": 0.5}
    assert judge(wider, ranked("x", "a"), baseline=ranked("a", "y")).value == 0.5


def test_agrees_top_k_on_an_empty_baseline_wants_an_empty_output() -> None:
    assert judge({"agrees": "top_k"}, [], baseline=[]).passed is True
    assert judge({"agrees": "top_k"}, ["a"], baseline=[]).passed is False


def test_agrees_cosine_compares_with_the_baseline_vector() -> None:
    assert judge({"agrees": "cosine"}, [1.0, 2.0], baseline=[1.0, 2.01]).passed is True
    assert judge({"agrees": "cosine"}, [1.0, 0.0], baseline=[0.0, 1.0]).passed is False


def test_agrees_close_to_defaults_to_no_difference() -> None:
    assert judge({"agrees": "close_to"}, [1.0, 2.0], baseline=[1, 2]) == Score(True, 0.0, "")
    assert judge({"agrees": "close_to"}, [1.0, 2.0], baseline=[1.0, 2.001]).passed is False
    assert judge({"agrees": "close_to", "abs": 0.01}, [1.0], baseline=[1.001]).passed is True


def test_agrees_close_to_fails_on_a_baseline_that_is_not_numbers() -> None:
    result = judge({"agrees": "close_to"}, [1.0], baseline=[math.nan])
    assert result == Score(False, None, "the baseline output is not finite numbers: [NaN]")


def test_agrees_fails_on_a_shape_mismatch_with_the_baseline() -> None:
    result = judge({"agrees": "close_to", "abs": 1}, [1.0, 2.0], baseline=[1.0, 2.0, 3.0])
    assert result == Score(False, None, "expected shape [3], got shape [2]")
