"""Ensemble wiring cases, valid and invalid, shared by the validator's unit tests and by the
integration test that asks a real tritonserver to load each one (the oracle)."""

from dataclasses import dataclass
from pathlib import Path

from apps.registry.codec import parse_pbtxt
from apps.registry.ensembles import Resolved, validate_ensemble
from apps.registry.validation import errors, validate_config

# Step models (one version each, Python backend; `dec` is decoupled). `inner`, `inner_flagged`
# (which says it is decoupled, but no step of it is) and `inner_dec` are themselves ensembles.
STEPS = {
    "tok": """
        name: "tok" backend: "python" max_batch_size: 8
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "IDS" data_type: TYPE_INT64 dims: [16] }]""",
    "enc": """
        name: "enc" backend: "python" max_batch_size: 8
        input [{ name: "IDS" data_type: TYPE_INT64 dims: [16] }]
        output [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]""",
    "enc32": """
        name: "enc32" backend: "python" max_batch_size: 8
        input [{ name: "IDS" data_type: TYPE_INT64 dims: [32] }]
        output [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]""",
    "enc_fp16": """
        name: "enc_fp16" backend: "python" max_batch_size: 8
        input [{ name: "IDS" data_type: TYPE_INT64 dims: [16] }]
        output [{ name: "VEC" data_type: TYPE_FP16 dims: [8] }]""",
    "head": """
        name: "head" backend: "python" max_batch_size: 8
        input [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]
        output [{ name: "LABEL" data_type: TYPE_STRING dims: [1] }]""",
    "two_in": """
        name: "two_in" backend: "python" max_batch_size: 8
        input [{ name: "A" data_type: TYPE_FP32 dims: [8] }, { name: "B" data_type: TYPE_FP32 dims: [8] }]
        output [{ name: "C" data_type: TYPE_FP32 dims: [8] }]""",
    "opt_in": """
        name: "opt_in" backend: "python" max_batch_size: 8
        input [{ name: "A" data_type: TYPE_FP32 dims: [8] },
               { name: "B" data_type: TYPE_FP32 dims: [8] optional: true }]
        output [{ name: "C" data_type: TYPE_FP32 dims: [8] }]""",
    "small_batch": """
        name: "small_batch" backend: "python" max_batch_size: 2
        input [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]
        output [{ name: "LABEL" data_type: TYPE_STRING dims: [1] }]""",
    "nobatch": """
        name: "nobatch" backend: "python" max_batch_size: 0
        input [{ name: "VEC" data_type: TYPE_FP32 dims: [-1, 8] }]
        output [{ name: "LABEL" data_type: TYPE_STRING dims: [-1, 1] }]""",
    "wide": """
        name: "wide" backend: "python" max_batch_size: 8
        input [{ name: "VEC" data_type: TYPE_FP32 dims: [-1] }]
        output [{ name: "VEC2" data_type: TYPE_FP32 dims: [-1] }]""",
    "dec": """
        name: "dec" backend: "python" max_batch_size: 8
        model_transaction_policy { decoupled: true }
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "IDS" data_type: TYPE_INT64 dims: [16] }]""",
    "inner": """
        name: "inner" platform: "ensemble" max_batch_size: 8
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]
        ensemble_scheduling { step [
          { model_name: "tok" model_version: 1 input_map { key: "TEXT" value: "TEXT" }
            output_map { key: "IDS" value: "ids" } },
          { model_name: "enc" model_version: 1 input_map { key: "IDS" value: "ids" }
            output_map { key: "VEC" value: "VEC" } } ] }""",
    "inner_flagged": """
        name: "inner_flagged" platform: "ensemble" max_batch_size: 8
        model_transaction_policy { decoupled: true }
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]
        ensemble_scheduling { step [
          { model_name: "tok" model_version: 1 input_map { key: "TEXT" value: "TEXT" }
            output_map { key: "IDS" value: "ids" } },
          { model_name: "enc" model_version: 1 input_map { key: "IDS" value: "ids" }
            output_map { key: "VEC" value: "VEC" } } ] }""",
    "inner_dec": """
        name: "inner_dec" platform: "ensemble" max_batch_size: 8
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "VEC" data_type: TYPE_FP32 dims: [8] }]
        ensemble_scheduling { step [
          { model_name: "dec" model_version: 1 input_map { key: "TEXT" value: "TEXT" }
            output_map { key: "IDS" value: "ids" } },
          { model_name: "enc" model_version: 1 input_map { key: "IDS" value: "ids" }
            output_map { key: "VEC" value: "VEC" } } ] }""",
}

TEXT_IN = 'input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]'
LABEL_OUT = 'output [{ name: "LABEL" data_type: TYPE_STRING dims: [1] }]'
C_IO = f'{TEXT_IN}\noutput [{{ name: "C" data_type: TYPE_FP32 dims: [8] }}]'


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = 1) -> str:
    maps = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += " " + " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {maps} }}'


CHAIN = [
    step("tok", {"TEXT": "TEXT"}, {"IDS": "ids"}),
    step("enc", {"IDS": "ids"}, {"VEC": "vec"}),
    step("head", {"VEC": "vec"}, {"LABEL": "LABEL"}),
]


@dataclass(frozen=True)
class Case:
    id: str
    steps: list[str]
    ok: bool
    says: str = ""  # a fragment the validator's first error must contain
    io: str = f"{TEXT_IN}\n{LABEL_OUT}"
    max_batch_size: int = 8
    extra: str = ""

    def config(self, name: str) -> str:
        steps = ",\n".join(self.steps).replace('"SELF"', f'"{name}"')
        return (
            f'name: "{name}" platform: "ensemble" max_batch_size: {self.max_batch_size}\n'
            f"{self.io}\n{self.extra}\nensemble_scheduling {{ step [\n{steps}\n] }}\n"
        )


CASES = [
    Case("chain", CHAIN, ok=True),
    Case(
        "latest_version",
        [CHAIN[0], CHAIN[1], step("head", {"VEC": "vec"}, {"LABEL": "LABEL"}, -1)],
        ok=True,
    ),
    Case("steps_out_of_order", [CHAIN[2], CHAIN[0], CHAIN[1]], ok=True),
    Case("smaller_ensemble_batch", CHAIN, ok=True, max_batch_size=4),
    Case(
        "wildcard_dims",
        [CHAIN[0], CHAIN[1], step("wide", {"VEC": "vec"}, {"VEC2": "OUT"})],
        ok=True,
        io=f'{TEXT_IN}\noutput [{{ name: "OUT" data_type: TYPE_FP32 dims: [-1] }}]',
    ),
    Case(
        "optional_input_unmapped",
        [CHAIN[0], CHAIN[1], step("opt_in", {"A": "vec"}, {"C": "C"})],
        ok=True,
        io=C_IO,
    ),
    Case(
        "fan_out",
        [CHAIN[0], CHAIN[1], CHAIN[2], step("two_in", {"A": "vec", "B": "vec"}, {"C": "C"})],
        ok=True,
        io=f'{TEXT_IN}\n{LABEL_OUT[:-1]}, {{ name: "C" data_type: TYPE_FP32 dims: [8] }}]',
    ),
    Case("nested_ensemble", [step("inner", {"TEXT": "TEXT"}, {"VEC": "vec"}), CHAIN[2]], ok=True),
    Case(
        "unbatched_ensemble_over_batching_steps",
        CHAIN,
        ok=True,
        max_batch_size=0,
        io='input [{ name: "TEXT" data_type: TYPE_STRING dims: [-1, 1] }]\n'
        'output [{ name: "LABEL" data_type: TYPE_STRING dims: [-1, 1] }]',
    ),
    Case(
        "unknown_model",
        [CHAIN[0], step("nope", {"IDS": "ids"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="nope",
    ),
    Case(
        "unknown_version",
        [CHAIN[0], step("enc", {"IDS": "ids"}, {"VEC": "vec"}, 7), CHAIN[2]],
        ok=False,
        says="v7",
    ),
    Case(
        "input_not_mapped",
        [CHAIN[0], CHAIN[1], step("two_in", {"A": "vec"}, {"C": "C"})],
        ok=False,
        says="input 'B'",
        io=C_IO,
    ),
    Case(
        "map_to_missing_input",
        [CHAIN[0], step("enc", {"IDS": "ids", "MASK": "ids"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="no input 'MASK'",
    ),
    Case(
        "map_from_missing_output",
        [CHAIN[0], step("enc", {"IDS": "ids"}, {"EMB": "vec"}), CHAIN[2]],
        ok=False,
        says="no output 'EMB'",
    ),
    Case(
        "tensor_produced_twice",
        [CHAIN[0], CHAIN[1], step("enc", {"IDS": "ids"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="produced twice",
    ),
    Case(
        "tensor_never_produced",
        [CHAIN[0], step("enc", {"IDS": "idz"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="'idz'",
    ),
    Case(
        "dtype_mismatch",
        [CHAIN[0], step("enc_fp16", {"IDS": "ids"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="TYPE_FP16",
    ),
    Case(
        "shape_mismatch",
        [CHAIN[0], step("enc32", {"IDS": "ids"}, {"VEC": "vec"}), CHAIN[2]],
        ok=False,
        says="shape [16]",
    ),
    Case(
        "batch_exceeds_step",
        [CHAIN[0], CHAIN[1], step("small_batch", {"VEC": "vec"}, {"LABEL": "LABEL"})],
        ok=False,
        says="max_batch_size 2",
    ),
    Case(
        "batching_ensemble_unbatched_step",
        [CHAIN[0], CHAIN[1], step("nobatch", {"VEC": "vec"}, {"LABEL": "LABEL"})],
        ok=True,
        io=f'{TEXT_IN}\noutput [{{ name: "LABEL" data_type: TYPE_STRING dims: [1] }}]',
    ),
    Case(
        "unbatched_ensemble_matches_by_dims",
        CHAIN,
        ok=True,
        max_batch_size=0,
        io='input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]\n'
        'output [{ name: "LABEL" data_type: TYPE_STRING dims: [-1, 1] }]',
    ),
    Case("output_not_produced", CHAIN[:2], ok=False, says="'LABEL' is produced by no step"),
    Case(
        "output_dtype_mismatch",
        CHAIN,
        ok=False,
        says="TYPE_FP32",
        io=f'{TEXT_IN}\noutput [{{ name: "LABEL" data_type: TYPE_FP32 dims: [1] }}]',
    ),
    Case(
        "output_shape_mismatch",
        CHAIN,
        ok=False,
        says="shape",
        io=f'{TEXT_IN}\noutput [{{ name: "LABEL" data_type: TYPE_STRING dims: [3] }}]',
    ),
    Case(
        "input_dtype_mismatch",
        CHAIN,
        ok=False,
        says="TYPE_INT32",
        io=f'input [{{ name: "TEXT" data_type: TYPE_INT32 dims: [1] }}]\n{LABEL_OUT}',
    ),
    Case(
        "input_shape_mismatch",
        CHAIN,
        ok=False,
        says="shape [2]",
        io=f'input [{{ name: "TEXT" data_type: TYPE_STRING dims: [2] }}]\n{LABEL_OUT}',
    ),
    Case(
        "unused_step_output",
        [
            CHAIN[0],
            CHAIN[1],
            step("head", {"VEC": "vec"}, {"LABEL": "LABEL"}),
            step("wide", {"VEC": "vec"}, {"VEC2": "spare"}),
        ],
        ok=False,
        says="'spare' is unused",
    ),
    Case(
        "unused_ensemble_input",
        CHAIN,
        ok=False,
        says="'EXTRA' is unused",
        io=f'{TEXT_IN[:-1]}, {{ name: "EXTRA" data_type: TYPE_FP32 dims: [8] }}]\n{LABEL_OUT}',
    ),
    Case(
        "cycle_between_steps",
        [
            CHAIN[0],
            CHAIN[1],
            step("two_in", {"A": "vec", "B": "c2"}, {"C": "c1"}),
            step("wide", {"VEC": "c1"}, {"VEC2": "c2"}),
            CHAIN[2],
        ],
        ok=False,
        says="cycle",
        io=f"{TEXT_IN}\n{LABEL_OUT}",
    ),
    Case(
        "self_reference",
        [CHAIN[0], CHAIN[1], step("SELF", {"TEXT": "TEXT"}, {"LABEL": "LABEL"})],
        ok=False,
        says="cycle of ensembles",
    ),
    Case("ensemble_with_backend", CHAIN, ok=False, says="backend", extra='backend: "python"'),
    Case(
        "ensemble_with_instances",
        CHAIN,
        ok=False,
        says="instance",
        extra="instance_group [{ kind: KIND_CPU count: 1 }]",
    ),
    Case("ensemble_without_steps", [], ok=False, says="at least one step"),
    # Triton refuses a step fed by tensors that descend from different decoupled steps (or from a
    # decoupled step and none): core's ensemble_utils.cc, ValidateEnsembleConfig.
    Case("decoupled_chain", [step("dec", {"TEXT": "TEXT"}, {"IDS": "ids"}), *CHAIN[1:]], ok=True),
    Case(
        "decoupled_fan_in_from_one_step",
        [
            step("dec", {"TEXT": "TEXT"}, {"IDS": "ids"}),
            CHAIN[1],
            step("wide", {"VEC": "vec"}, {"VEC2": "vec2"}),
            step("two_in", {"A": "vec", "B": "vec2"}, {"C": "C"}),
        ],
        ok=True,
        io=C_IO,
    ),
    Case(
        "decoupled_and_plain_inputs",
        [
            *CHAIN[:2],
            step("dec", {"TEXT": "TEXT"}, {"IDS": "ids2"}),
            step("enc", {"IDS": "ids2"}, {"VEC": "vec2"}),
            step("two_in", {"A": "vec", "B": "vec2"}, {"C": "C"}),
        ],
        ok=False,
        says="receives inputs originated from different decoupled models",
        io=C_IO,
    ),
    Case(
        "two_decoupled_steps_into_one",
        [
            step("dec", {"TEXT": "TEXT"}, {"IDS": "ids"}),
            CHAIN[1],
            step("dec", {"TEXT": "TEXT"}, {"IDS": "ids2"}),
            step("enc", {"IDS": "ids2"}, {"VEC": "vec2"}),
            step("two_in", {"A": "vec", "B": "vec2"}, {"C": "C"}),
        ],
        ok=False,
        says="receives inputs originated from different decoupled models",
        io=C_IO,
    ),
    Case(
        "outputs_from_different_decoupled_models",
        [
            step("dec", {"TEXT": "TEXT"}, {"IDS": "ids"}),
            *CHAIN[1:],
            step("tok", {"TEXT": "TEXT"}, {"IDS": "ids2"}),
            step("enc", {"IDS": "ids2"}, {"VEC": "C"}),
        ],
        ok=False,
        says="ensemble outputs originate from different decoupled models",
        io=f'{TEXT_IN}\n{LABEL_OUT[:-1]}, {{ name: "C" data_type: TYPE_FP32 dims: [8] }}]',
    ),
    Case(
        "ensemble_flagged_decoupled_over_plain_steps",
        [
            step("inner_flagged", {"TEXT": "TEXT"}, {"VEC": "vec"}),
            *CHAIN[:1],
            step("enc", {"IDS": "ids"}, {"VEC": "vec2"}),
            step("two_in", {"A": "vec", "B": "vec2"}, {"C": "C"}),
        ],
        ok=True,
        io=C_IO,
    ),
    Case(
        "decoupled_nested_ensemble_and_plain_inputs",
        [
            step("inner_dec", {"TEXT": "TEXT"}, {"VEC": "vec"}),
            *CHAIN[:1],
            step("enc", {"IDS": "ids"}, {"VEC": "vec2"}),
            step("two_in", {"A": "vec", "B": "vec2"}, {"C": "C"}),
        ],
        ok=False,
        says="receives inputs originated from different decoupled models",
        io=C_IO,
    ),
]

# Ensembles imported together with STEPS as one repository (issue 15). `a_outer` uses `b_middle`,
# itself over the ensemble `inner`: each is judged after the ensembles it uses, whatever the order
# of their names. `loop_a` and `loop_b` use each other, a cycle Triton refuses. (An ensemble over
# one of them is no case: tritonserver 2.51 dies loading it, so only the unit tests have one.)
REPOSITORY_CASES = [
    Case("a_outer", [step("b_middle", {"TEXT": "TEXT"}, {"VEC": "vec"}), CHAIN[2]], ok=True),
    Case(
        "b_middle",
        [step("inner", {"TEXT": "TEXT"}, {"VEC": "VEC"})],
        ok=True,
        io=f'{TEXT_IN}\noutput [{{ name: "VEC" data_type: TYPE_FP32 dims: [8] }}]',
    ),
    Case(
        "loop_a",
        [step("loop_b", {"TEXT": "TEXT"}, {"LABEL": "LABEL"})],
        ok=False,
        says="ensemble cycle: loop_a -> loop_b -> loop_a",
    ),
    Case(
        "loop_b",
        [step("loop_a", {"TEXT": "TEXT"}, {"LABEL": "LABEL"})],
        ok=False,
        says="ensemble cycle: loop_b -> loop_a -> loop_b",
    ),
]

# Models on their own, as Triton takes or refuses them whatever calls them: by name, the config
# (named so) and whether the validator must take it.
MODEL_CASES = {
    "dec_cached": (
        STEPS["dec"].replace('"dec"', '"dec_cached"') + " response_cache { enable: true }",
        False,
    ),
    "tok_cached": (
        STEPS["tok"].replace('"tok"', '"tok_cached"') + " response_cache { enable: true }",
        True,
    ),
    "dec_batched": (
        STEPS["dec"].replace('"dec"', '"dec_batched"')
        + " dynamic_batching { max_queue_delay_microseconds: 100 }",
        True,
    ),
}

# Loading is all the cases need: the steps never run.
STEP_MODEL = """class TritonPythonModel:
    def execute(self, requests):
        return [None for _ in requests]
"""


def write_repository(repository: Path, configs: dict[str, str]) -> None:
    """A Triton model repository: each model with its config and version 1 (with a model.py for
    the Python steps)."""
    for name, text in configs.items():
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        (repository / name / "config.pbtxt").write_text(text)
        if 'platform: "ensemble"' not in text:
            (repository / name / "1" / "model.py").write_text(STEP_MODEL)


def repository_configs() -> dict[str, str]:
    """STEPS and REPOSITORY_CASES, by model name."""
    return STEPS | {case.id: case.config(case.id) for case in REPOSITORY_CASES}


STEP_CONFIGS = {name: parse_pbtxt(text) for name, text in STEPS.items()}


def verdict(case: Case) -> list[str]:
    """The validator's errors for `case`, its steps resolved from STEPS."""
    name = f"ens_{case.id}"
    config = parse_pbtxt(case.config(name))

    def resolve(model: str, version: int) -> Resolved:
        found = STEP_CONFIGS.get(model) or (config if model == name else None)
        if found is None:
            return Resolved(None, reason=f"model '{model}' is not in the registry")
        if version not in (-1, 1):
            return Resolved(None, reason=f"{model} has no version v{version} (it has [1])")
        return Resolved(found, 1)

    problems = validate_config(config) + validate_ensemble(config, resolve)
    return [str(p) for p in errors(problems)]
