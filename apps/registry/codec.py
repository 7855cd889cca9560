"""Triton model configs through Triton's own protobuf schema: pbtxt in, pbtxt or JSON out."""

import json
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

ModelConfig = model_config_pb2.ModelConfig
# Real configs are a few KB; protobuf's text parser takes about a second per megabyte.
MAX_CONFIG_CHARS = 200_000


class ConfigSyntaxError(ValueError):
    """A config.pbtxt that Triton could not parse; names the file, line and column."""

    def __init__(self, source: str, line: int, column: int, message: str) -> None:
        self.source, self.line, self.column = source, line, column
        super().__init__(f"{source}:{line}:{column}: {message}")


def parse_pbtxt(text: str, *, source: str = "config.pbtxt") -> Any:
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigSyntaxError(
            source, 1, 1, f"{len(text):,} characters; a config may hold {MAX_CONFIG_CHARS:,}"
        )
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigSyntaxError(
            source, exc.GetLine() or 0, exc.GetColumn() or 0, str(exc).split(" : ", 1)[-1]
        ) from exc
    return config


def to_pbtxt(config: Any) -> str:
    return text_format.MessageToString(config)


def to_dict(config: Any) -> dict[str, Any]:
    """The JSON shape Triton's repository API takes as the `config` load parameter."""
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def to_json(config: Any) -> str:
    return json.dumps(to_dict(config), sort_keys=True)


def from_dict(data: dict[str, Any], *, ignore_unknown_fields: bool = False) -> Any:
    return json_format.ParseDict(data, ModelConfig(), ignore_unknown_fields=ignore_unknown_fields)


def pin_versions(config: Any, versions: list[int]) -> Any:
    """A copy of `config` whose version policy serves exactly `versions`."""
    pinned = ModelConfig()
    pinned.CopyFrom(config)
    pinned.version_policy.specific.versions[:] = sorted(versions)
    return pinned


def without_version_policy(config: Any) -> Any:
    """A copy of `config` without its version policy (the deployment decides which versions)."""
    copy = ModelConfig()
    copy.CopyFrom(config)
    copy.ClearField("version_policy")
    return copy


def ensemble_steps(config: Any) -> list[tuple[str, int]]:
    """(model, version) of each step of an ensemble; -1 means the latest version."""
    return [(s.model_name, s.model_version) for s in config.ensemble_scheduling.step]


def step_names(config: dict[str, Any]) -> set[str]:
    """The models an ensemble's stored (JSON) config calls; empty for any other model."""
    return {name for name, _ in stored_steps(config)}


def stored_steps(config: dict[str, Any]) -> list[tuple[str, int]]:
    """`ensemble_steps` of a stored (JSON) config, without parsing it: empty for any model but an
    ensemble (JSON writes int64 as a string)."""
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    return [(s.get("model_name", ""), int(s.get("model_version", -1))) for s in steps]


def int_parameter(config: Any, key: str) -> int | None:
    """A config's `parameters` entry `key` as a whole number, if it has one that is."""
    if key not in config.parameters:
        return None
    value = config.parameters[key].string_value.strip()
    return int(value) if value.isdecimal() else None


def tuned(config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """`config` (the JSON shape) with `fields` laid over it: objects field by field, lists of
    objects item by item (an instance group keeps its kind when only its count is advised),
    anything else replaced."""
    merged = dict(config)
    for name, value in fields.items():
        here = merged.get(name)
        if isinstance(value, dict) and isinstance(here, dict):
            merged[name] = tuned(here, value)
        elif isinstance(value, list) and isinstance(here, list):
            merged[name] = [
                tuned(here[i], item) if i < len(here) and isinstance(item, dict) else item
                for i, item in enumerate(value)
            ] + here[len(value) :]
        else:
            merged[name] = value
    return merged
