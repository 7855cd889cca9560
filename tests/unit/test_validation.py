import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.registry.codec import ConfigSyntaxError, parse_pbtxt
from apps.registry.validation import validate_config

GOOD = """
name: "m" backend: "onnxruntime" max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [3, -1] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [10] }]
"""


def problems(text: str, **kwargs: str) -> list[str]:
    return [
        f"{p.level} {p.field}: {p.message}" for p in validate_config(parse_pbtxt(text), **kwargs)
    ]


def test_a_good_config_has_no_problems() -> None:
    assert problems(GOOD) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (('name: "m"', 'name: ""'), "error name: is required"),
        (('backend: "onnxruntime"', ""), "error backend: a backend (or a platform) is required"),
        (
            ('backend: "onnxruntime"', 'backend: "my_custom"'),
            "warning backend: 'my_custom' is not a standard",
        ),
        (
            ('backend: "onnxruntime"', 'platform: "tensorrt_plan" backend: "onnxruntime"'),
            "contradicts platform",
        ),
        (("max_batch_size: 8", "max_batch_size: -1"), "error max_batch_size: must be >= 0"),
        (
            ("dims: [10] }]", 'dims: [10] }, { name: "y" data_type: TYPE_FP32 dims: [1] }]'),
            "error output[y]: duplicate output name 'y'",
        ),
        (
            ("data_type: TYPE_FP32 dims: [10]", "dims: [10]"),
            "error output[y].data_type: is required",
        ),
        (("dims: [3, -1]", "dims: [3, 0]"), "error input[x].dims: 0 is not a dimension"),
        (("dims: [3, -1]", ""), "error input[x].dims: are required"),
        (
            (
                "max_batch_size: 8",
                "max_batch_size: 8 instance_group [{ kind: KIND_CPU gpus: [0] }]",
            ),
            "a KIND_CPU group cannot name GPUs",
        ),
        (
            (
                "max_batch_size: 8",
                "max_batch_size: 8 dynamic_batching { preferred_batch_size: [4, 16] }",
            ),
            "16 must be between 1 and max_batch_size (8)",
        ),
        (
            ("max_batch_size: 8", "max_batch_size: 0 dynamic_batching { }"),
            "warning dynamic_batching: has no effect",
        ),
        (
            (
                "max_batch_size: 8",
                "max_batch_size: 8 version_policy { specific { versions: [0] } }",
            ),
            "versions are integers >= 1",
        ),
        (
            (
                "max_batch_size: 8",
                "max_batch_size: 8 version_policy { latest { num_versions: 0 } }",
            ),
            "must be >= 1",
        ),
        (
            (
                "max_batch_size: 8",
                'max_batch_size: 8 sequence_batching { control_input [{ name: "S" control [{ '
                "kind: CONTROL_SEQUENCE_START int32_false_true: [0] }] }] }",
            ),
            "with two values",
        ),
        (
            (
                "max_batch_size: 8",
                'max_batch_size: 8 sequence_batching { control_input [{ name: "S" control [{ '
                "kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] }, { kind: CONTROL_SEQUENCE_START "
                "int32_false_true: [0, 1] }] }] }",
            ),
            "CONTROL_SEQUENCE_START is given more than once",
        ),
        (
            ("max_batch_size: 8", "max_batch_size: 8 ensemble_scheduling { }"),
            "only models with platform 'ensemble'",
        ),
    ],
)
def test_triton_rules_for_one_config(change: tuple[str, str], expected: str) -> None:
    old, new = change
    found = problems(GOOD.replace(old, new, 1))
    assert any(expected in line for line in found), found


def test_the_config_name_must_match_its_directory() -> None:
    assert problems(GOOD, expected_name="other") == [
        "error name: 'm' does not match the model directory 'other'"
    ]


def test_an_ensemble_carries_no_backend_instances_or_warmup() -> None:
    text = """name: "e" platform: "ensemble" backend: "python" max_batch_size: 1
      input [{ name: "a" data_type: TYPE_FP32 dims: [1] }] output [{ name: "b" data_type: TYPE_FP32 dims: [1] }]
      instance_group [{ kind: KIND_CPU }] model_warmup [{ name: "w" }]"""
    found = "\n".join(problems(text))
    for expected in [
        "backend: an ensemble runs no backend",
        "instance_group: an ensemble has no instances",
        "model_warmup: an ensemble cannot be warmed up",
        "ensemble_scheduling: an ensemble needs",
    ]:
        assert expected in found


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ('name: "m"\nmax_batch_size: "eight"\n', 2, "max_batch_size"),
        ('name: "m"\ninput [{ name: "x" data_type: TYPE_FLOAT }]\n', 2, "TYPE_FLOAT"),
        ('name: "m"\n\nbogus_field: 1\n', 3, "bogus_field"),
        ('name: "m"\ninput { name: "x"\n', 2, 'Expected "}"'),
    ],
)
def test_broken_pbtxt_reports_line_and_what(text: str, line: int, fragment: str) -> None:
    with pytest.raises(ConfigSyntaxError) as caught:
        parse_pbtxt(text, source="m/config.pbtxt")
    assert caught.value.line == line
    assert fragment in str(caught.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_gives_a_config_or_a_typed_error(text: str) -> None:
    try:
        config = parse_pbtxt(text)
    except ConfigSyntaxError as exc:
        assert exc.line >= 0 and exc.column >= 0
    else:
        validate_config(config)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                'name: "m"',
                "input",
                "{",
                "}",
                "[",
                "]",
                "dims:",
                "-1",
                "7",
                ",",
                ":",
                "data_type:",
                "TYPE_FP32",
                "max_batch_size:",
                '"x"',
                "#",
                "\n",
            ]
        ),
        max_size=60,
    )
)
def test_config_shaped_noise_gives_a_config_or_a_typed_error(tokens: list[str]) -> None:
    with contextlib.suppress(ConfigSyntaxError):
        validate_config(parse_pbtxt(" ".join(tokens)))
