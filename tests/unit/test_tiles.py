"""The overview tiles' arithmetic, with Prometheus stubbed at its module boundary (the tiles are
checked against a real Prometheus in tests/integration/test_chart_agreement.py)."""

import pytest

from apps.observability import breakdown, tiles
from apps.registry.models import Model, ModelVersion

PIPELINE = {"ensemble_scheduling": {"step": [{"model_name": "embedder"}, {"model_name": "llm"}]}}


def answer(query: str) -> list[tuple[dict[str, str], float]]:
    if "nv_inference_request_success" in query:
        return [({"model": "rag"}, 10.0), ({"model": "embedder"}, 10.0), ({"model": "ocr"}, 5.0)]
    if "nv_inference_request_failure" in query:
        return [({"model": "rag"}, 1.0), ({"model": "llm"}, 4.0)]
    assert "nv_inference_request_summary_us" in query
    return [
        ({"model": "llm", "version": "2"}, 90.0),  # the slowest, but within its budget
        ({"model": "embedder", "version": "1"}, 30.0),  # a third over its budget
        ({"model": "ocr", "version": "1"}, 400.0),  # no budget: ranks after every budget
    ]


@pytest.fixture
def registry(db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiles, "instant_query", answer)
    monkeypatch.setattr(breakdown, "instant_query", answer)
    rag = Model.objects.create(name="rag", kind=Model.Kind.ENSEMBLE, latency_budget_ms=500)
    ModelVersion.objects.create(model=rag, version=1, config=PIPELINE)
    Model.objects.create(name="embedder", latency_budget_ms=23)
    Model.objects.create(name="llm", latency_budget_ms=100)
    Model.objects.create(name="ocr")


def test_requests_count_once_at_their_entry_point(registry: None) -> None:
    found = tiles.fleet_tiles()
    assert found.throughput_rps == 15.0  # rag and ocr; embedder's requests came through rag
    assert found.error_ratio == pytest.approx(1 / 16)


def test_the_worst_p99_is_the_one_furthest_over_its_budget(registry: None) -> None:
    worst = tiles.fleet_tiles().worst
    assert worst == tiles.Worst("embedder", 1, 30.0, 23)
    assert worst.breach


def test_no_requests_is_not_zero_errors(db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiles, "instant_query", lambda query: [])
    found = tiles.fleet_tiles()
    assert (found.throughput_rps, found.error_ratio, found.worst) == (0, None, None)
