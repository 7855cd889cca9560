"""The demo models' computation, run outside Triton (the integration tests run it inside)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "deploy" / "ragkit"))
import ragkit


def answer(question: str, *, version: int) -> tuple[str, str]:
    refined = version > 1
    embedding = ragkit.embed(question, refined=refined)
    candidates = ragkit.retrieve(embedding, refined=refined, k=6 if refined else 4)
    ranked = ragkit.rerank(question, candidates, refined=refined)
    return ragkit.generate(question, ranked, friendly=refined)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("question", "source"),
    [
        ("How do I reset my password?", "faq:account-password"),
        ("When will I get my refund?", "faq:refund-time"),
        ("Do you ship internationally?", "faq:shipping-international"),
    ],
)
def test_questions_find_their_faq_entry(question: str, source: str, version: int) -> None:
    text, found = answer(question, version=version)
    assert found == source
    faq = {f"faq:{entry['id']}": entry["a"] for entry in ragkit.FAQ}
    assert faq[source] in text


def test_the_improved_chain_answers_more_questions_right() -> None:
    questions = {
        "i forgot my password": "faq:account-password",
        "the parcel came broken": "faq:damaged-item",
        "how much does delivery cost": "faq:shipping-cost",
        "can i pay with paypal": "faq:payment-methods",
        "returning shoes that do not fit": "faq:returns-how",
    }
    right = {v: sum(answer(q, version=v)[1] == s for q, s in questions.items()) for v in (1, 2)}
    assert right[2] >= right[1]


def test_embeddings_are_unit_vectors_of_fixed_size() -> None:
    vector = ragkit.embed("Where is my invoice?", refined=True)
    assert vector.shape == (ragkit.DIMS,)
    assert np.isclose(np.linalg.norm(vector), 1.0)


def test_drill_parameters_come_from_the_model_config() -> None:
    model = ragkit.GeneratorV1()
    parameters = {
        "delay_ms": {"string_value": "250"},
        "error_rate": {"string_value": "0.5"},
        "alloc_mb": {"string_value": "2"},
    }
    model.initialize({"model_config": json.dumps({"parameters": parameters})})
    assert (model.delay_s, model.error_rate) == (0.25, 0.5)
    assert model.ballast.nbytes == 2 * 2**20 and model.ballast.all()  # written, so resident


def test_candidates_survive_the_string_tensor_encoding() -> None:
    candidates = ragkit.retrieve(ragkit.embed("refund", refined=False), refined=False, k=4)
    assert ragkit.decode(ragkit.encode(candidates)) == candidates


def test_the_runtime_fault_knob_is_read_again_whenever_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `devfleet fault` writes, each demo model reads at its next request, no reload."""
    from apps.devtools.devfleet import Devfleet

    (tmp_path / "models").mkdir()
    fleet = Devfleet(home=tmp_path / "home", repository=tmp_path / "models")
    monkeypatch.setattr(ragkit, "FAULTS", tmp_path / "faults.json")
    faults = ragkit.Faults()
    assert faults.of("reranker") == (0.0, 0.0)  # no file: no fault
    fleet.fault("reranker", delay_ms=400)
    fleet.fault("generator", error_rate=0.2)
    assert (faults.of("reranker"), faults.of("generator")) == ((0.4, 0.0), (0.0, 0.2))
    fleet.fault("reranker")  # healed; the generator's stays
    assert (faults.of("reranker"), faults.of("generator")) == ((0.0, 0.0), (0.0, 0.2))
