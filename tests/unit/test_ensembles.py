from typing import Any

import pytest

from apps.registry.codec import from_dict
from apps.registry.ensembles import Resolved, UnresolvedStep, pinned_steps
from tests.support.ensemble_cases import CASES, Case, verdict


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


def test_pinned_steps_resolve_the_latest_and_with_nested_the_inner_ensembles_steps() -> None:
    def ensemble(name: str, steps: list[tuple[str, int]]) -> Any:
        scheduling = {"step": [{"model_name": m, "model_version": v} for m, v in steps]}
        return from_dict({"name": name, "platform": "ensemble", "ensemble_scheduling": scheduling})

    inner = ensemble("inner", [("tokenizer", 1)])
    registry = {("inner", 2): inner, ("tokenizer", 1): from_dict({"name": "tokenizer"})}
    registry |= {("tokenizer", 3): from_dict({"name": "tokenizer"})}
    latest = {"inner": 2, "tokenizer": 3}

    def resolve(model: str, version: int) -> Resolved:
        number = latest.get(model, 0) if version == -1 else version
        if (model, number) not in registry:
            return Resolved(None, reason=f"model '{model}' has no version v{version}")
        return Resolved(registry[(model, number)], number)

    outer = ensemble("outer", [("tokenizer", -1), ("inner", -1), ("tokenizer", 3)])
    assert list(pinned_steps(outer, resolve)) == [("tokenizer", 3), ("inner", 2)]
    nested = pinned_steps(outer, resolve, nested=True)
    assert list(nested) == [("tokenizer", 3), ("inner", 2), ("tokenizer", 1)]
    assert nested[("inner", 2)] is inner
    assert pinned_steps(from_dict({"name": "tokenizer"}), resolve) == {}
    with pytest.raises(UnresolvedStep, match="model 'llm' has no version v4"):
        pinned_steps(ensemble("broken", [("tokenizer", 1), ("llm", 4)]), resolve)
