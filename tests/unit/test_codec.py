from pathlib import Path

import pytest

from apps.registry.codec import (
    ConfigSyntaxError,
    ensemble_steps,
    from_dict,
    parse_pbtxt,
    pin_versions,
    to_dict,
    to_pbtxt,
)
from apps.registry.repository import read_model, read_repository

REPOSITORY = Path(__file__).parents[2] / "deploy" / "models"


def test_pbtxt_and_json_round_trip_exactly() -> None:
    config = read_model(REPOSITORY, "reranker").configs[1]
    assert parse_pbtxt(to_pbtxt(config)) == config
    assert from_dict(to_dict(config)) == config


def test_syntax_error_reports_file_line_and_column() -> None:
    text = 'name: "m"\nbackend: "python"\nmax_batch_size: eight\n'
    with pytest.raises(ConfigSyntaxError) as caught:
        parse_pbtxt(text, source="m/config.pbtxt")
    assert (caught.value.source, caught.value.line) == ("m/config.pbtxt", 3)
    assert str(caught.value).startswith("m/config.pbtxt:3:")


def test_pinning_versions_leaves_the_original_untouched() -> None:
    config = read_model(REPOSITORY, "embedder").configs[2]
    pinned = pin_versions(config, [2, 1])
    assert list(pinned.version_policy.specific.versions) == [1, 2]
    assert not config.HasField("version_policy")


def test_demo_repository_ships_every_model_with_two_or_more_versions() -> None:
    models = {m.name: m.versions for m in read_repository(REPOSITORY)}
    assert models == {
        "embedder": [1, 2],
        "generator": [1, 2],
        "rag_pipeline": [1, 2, 3, 4],
        "reranker": [1, 2, 3],
        "retriever": [1, 2],
    }


def test_ensemble_versions_pin_their_steps() -> None:
    configs = read_model(REPOSITORY, "rag_pipeline").configs
    assert ensemble_steps(configs[1]) == [
        ("embedder", 1),
        ("retriever", 1),
        ("reranker", 1),
        ("generator", 1),
    ]
    assert ("reranker", 3) in ensemble_steps(configs[3])  # the slow chain
    assert "reranker" not in dict(ensemble_steps(configs[4]))  # the degraded chain
