import pytest

from apps.registry.codec import parse_pbtxt
from apps.registry.ensembles import Resolved, validate_ensemble
from apps.registry.validation import errors, validate_config
from tests.ensemble_cases import CASES, STEPS, Case

STEP_CONFIGS = {name: parse_pbtxt(text) for name, text in STEPS.items()}


def verdict(case: Case) -> list[str]:
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


def test_there_are_thirty_cases_or_more_covering_both_verdicts() -> None:
    assert len(CASES) >= 30
    assert {case.ok for case in CASES} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_ensemble_verdict(case: Case) -> None:
    found = verdict(case)
    if case.ok:
        assert found == []
    else:
        assert found, "expected an error"
        assert case.says in found[0], found
        assert found[0].startswith(f"ens_{case.id}: ")


def test_errors_name_the_ensemble_step_tensor_and_model() -> None:
    (case,) = [c for c in CASES if c.id == "dtype_mismatch"]
    assert verdict(case) == [
        "ens_dtype_mismatch: ensemble_scheduling.step[2].input_map[VEC]: tensor 'vec' is TYPE_FP16 "
        "from step[1] (enc_fp16 v1) but input 'VEC' of step (head v1) expects TYPE_FP32"
    ]


def test_a_step_fed_from_different_decoupled_models_names_each_tensor_and_its_origin() -> None:
    (case,) = [c for c in CASES if c.id == "decoupled_and_plain_inputs"]
    assert verdict(case) == [
        "ens_decoupled_and_plain_inputs: ensemble_scheduling.step[4]: step[4] (two_in v1) "
        "receives inputs originated from different decoupled models: 'vec' from no decoupled "
        "model, 'vec2' from decoupled step[2] (dec v1)"
    ]
