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
from tests.support import REPOSITORY


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
        "llm": [1, 2, 3, 4, 5],
        "rag_pipeline": list(range(1, 15)),
        "reranker": [1, 2, 3, 4, 5, 6],
        "retriever": [1, 2, 3, 4],
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


def pytriton_configs(tmp_path: Path) -> list[str]:
    """config.pbtxt files written by pytriton's own generator (a real producer of Triton configs)."""
    import numpy as np
    from pytriton.model_config.common import DeviceKind
    from pytriton.model_config.generator import ModelConfigGenerator
    from pytriton.model_config.model_config import DynamicBatcher
    from pytriton.model_config.triton_model_config import (
        ResponseCache,
        TensorSpec,
        TritonModelConfig,
    )

    specs = [
        TritonModelConfig(
            model_name="decoupled",
            max_batch_size=16,
            batcher=DynamicBatcher(preferred_batch_size=[4, 8], max_queue_delay_microseconds=100),
            instance_group={DeviceKind.KIND_CPU: 2},
            decoupled=True,
            backend_parameters={"shared-memory-socket": "ipc:///tmp/x"},
            inputs=[
                TensorSpec("INPUT_1", (-1,), np.float32),
                TensorSpec("TEXT", (1,), object, optional=True),
            ],
            outputs=[TensorSpec("OUT", (-1, 3), np.int64)],
        ),
        TritonModelConfig(
            model_name="unbatched",
            batching=False,
            max_batch_size=0,
            inputs=[TensorSpec("IMAGE", (224, 224, 3), np.uint8)],
            outputs=[TensorSpec("LOGITS", (1000,), np.float16)],
        ),
        TritonModelConfig(
            model_name="gpu_pair",
            max_batch_size=64,
            response_cache=ResponseCache(enable=True),  # Triton refuses one to a decoupled model
            instance_group={DeviceKind.KIND_GPU: 2},
            inputs=[TensorSpec("A", (8,), np.int32), TensorSpec("B", (8,), np.bool_)],
            outputs=[TensorSpec("SUM", (8,), np.float64)],
        ),
    ]
    texts = []
    for spec in specs:
        path = tmp_path / spec.model_name / "config.pbtxt"
        path.parent.mkdir()
        ModelConfigGenerator(spec).to_file(path)
        texts.append(path.read_text())
    return texts


def every_demo_config() -> list[str]:
    return sorted(str(p) for p in REPOSITORY.rglob("config.pbtxt"))


@pytest.mark.parametrize("path", every_demo_config())
def test_every_demo_config_round_trips(path: str) -> None:
    config = parse_pbtxt(Path(path).read_text(), source=path)
    assert parse_pbtxt(to_pbtxt(config)) == config
    assert from_dict(to_dict(config)) == config
    assert to_pbtxt(parse_pbtxt(to_pbtxt(config))) == to_pbtxt(config)


def test_configs_from_pytriton_round_trip_and_validate(tmp_path: Path) -> None:
    from apps.registry.validation import errors, validate_config

    for text in pytriton_configs(tmp_path):
        config = parse_pbtxt(text)
        canonical = to_pbtxt(config)
        # pytriton spells out some proto3 defaults (max_batch_size: 0); the canonical form drops them.
        assert parse_pbtxt(canonical) == config
        assert to_pbtxt(parse_pbtxt(canonical)) == canonical
        assert from_dict(to_dict(config)) == config
        assert errors(validate_config(config)) == []
