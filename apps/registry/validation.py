"""Triton's rules for one model config, checked before a node sees it.

Follows docs/user_guide/model_configuration.md and the comments of model_config.proto. Every
problem names the model and the field (`input[QUESTION].dims`), and is an error (Triton would refuse
the model) or a warning (Triton loads it, but someone should look).
"""

from dataclasses import dataclass
from typing import Any, Literal

from apps.registry.codec import model_config_pb2

ENSEMBLE = "ensemble"
# Triton loads any backend by name from its backend directory: an unknown name is only a warning.
KNOWN_BACKENDS = {
    "tensorrt",
    "onnxruntime",
    "pytorch",
    "tensorflow",
    "python",
    "openvino",
    "fil",
    "dali",
    "identity",
    "repeat",
    "square",
    "vllm",
    "tensorrtllm",
}
# The legacy platform names and the backend each implies.
PLATFORMS = {
    "tensorrt_plan": "tensorrt",
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
    ENSEMBLE: "",
}
WILDCARD = -1
Kind = model_config_pb2.ModelInstanceGroup.Kind
Control = model_config_pb2.ModelSequenceBatching.Control


@dataclass(frozen=True)
class Problem:
    level: Literal["error", "warning"]
    model: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.model}: {self.field}" if self.field else self.model
        return f"{where}: {self.message}"


class _Collector:
    def __init__(self, model: str) -> None:
        self.model = model or "<unnamed>"
        self.problems: list[Problem] = []

    def error(self, field: str, message: str) -> None:
        self.problems.append(Problem("error", self.model, field, message))

    def warning(self, field: str, message: str) -> None:
        self.problems.append(Problem("warning", self.model, field, message))


def is_ensemble(config: Any) -> bool:
    return bool(config.platform == ENSEMBLE)


def validate_config(config: Any, *, expected_name: str = "") -> list[Problem]:
    """Problems of one config on its own; ensemble wiring is `ensembles.validate_ensemble`'s job."""
    out = _Collector(config.name or expected_name)
    if not config.name:
        out.error("name", "is required")
    elif expected_name and config.name != expected_name:
        out.error("name", f"'{config.name}' does not match the model directory '{expected_name}'")
    _check_platform(config, out)
    if config.max_batch_size < 0:
        out.error(
            "max_batch_size", f"must be >= 0 (0 disables batching), got {config.max_batch_size}"
        )
    _check_tensors(config, out)
    _check_instance_groups(config, out)
    _check_batching(config, out)
    _check_version_policy(config, out)
    if config.response_cache.enable and config.model_transaction_policy.decoupled:
        # Triton core, model_config_utils.cc: a cached response is one, a stream is many.
        out.error(
            "response_cache",
            "Response Cache does not currently support a model with 'decoupled' transaction "
            "policy; disable the response cache",
        )
    return out.problems


def _check_platform(config: Any, out: _Collector) -> None:
    if is_ensemble(config):
        if config.backend:
            out.error("backend", f"an ensemble runs no backend, remove backend '{config.backend}'")
        if not config.HasField("ensemble_scheduling"):
            out.error("ensemble_scheduling", "an ensemble needs its steps in ensemble_scheduling")
        elif not config.ensemble_scheduling.step:
            out.error("ensemble_scheduling.step", "an ensemble needs at least one step")
        if config.instance_group:
            out.error("instance_group", "an ensemble has no instances of its own")
        if config.model_warmup:
            out.error("model_warmup", "an ensemble cannot be warmed up; warm up its steps")
        return
    if config.HasField("ensemble_scheduling"):
        out.error("ensemble_scheduling", "only models with platform 'ensemble' have steps")
    if not config.backend and not config.platform:
        out.error("backend", "a backend (or a platform) is required")
    if config.platform and config.platform not in PLATFORMS:
        out.error("platform", f"unknown platform '{config.platform}'")
    implied = PLATFORMS.get(config.platform, "")
    if config.backend and implied and config.backend != implied:
        out.error("backend", f"'{config.backend}' contradicts platform '{config.platform}'")
    if config.backend and config.backend not in KNOWN_BACKENDS:
        out.warning(
            "backend", f"'{config.backend}' is not a standard backend; nodes need it installed"
        )


def _check_tensors(config: Any, out: _Collector) -> None:
    for kind, tensors in (("input", config.input), ("output", config.output)):
        if not tensors:
            out.error(kind, f"the model declares no {kind}s")
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            field = f"{kind}[{tensor.name or index}]"
            if not tensor.name:
                out.error(field, "a tensor needs a name")
            elif tensor.name in seen:
                out.error(field, f"duplicate {kind} name '{tensor.name}'")
            seen.add(tensor.name)
            if tensor.data_type == model_config_pb2.TYPE_INVALID:
                out.error(f"{field}.data_type", "is required (TYPE_FP32, TYPE_STRING, ...)")
            _check_dims(field, list(tensor.dims), out, reshaped=tensor.HasField("reshape"))
            if tensor.HasField("reshape"):
                _check_dims(f"{field}.reshape", list(tensor.reshape.shape), out, reshaped=True)


def _check_dims(field: str, dims: list[int], out: _Collector, *, reshaped: bool) -> None:
    if not dims and not reshaped:
        out.error(f"{field}.dims", "are required (use [1] for one value per batch item)")
    for dim in dims:
        if dim < 1 and dim != WILDCARD:
            out.error(f"{field}.dims", f"{dim} is not a dimension: use an integer >= 1, or -1")


def _check_instance_groups(config: Any, out: _Collector) -> None:
    names: set[str] = set()
    for index, group in enumerate(config.instance_group):
        field = f"instance_group[{group.name or index}]"
        if group.name and group.name in names:
            out.error(field, f"duplicate instance group name '{group.name}'")
        names.add(group.name)
        if group.count < 0:
            out.error(f"{field}.count", f"must be >= 1, got {group.count}")
        if group.kind == Kind.KIND_CPU and group.gpus:
            out.error(f"{field}.gpus", "a KIND_CPU group cannot name GPUs")
        if group.kind == Kind.KIND_MODEL and group.gpus:
            out.error(f"{field}.gpus", "a KIND_MODEL group places itself; it cannot name GPUs")
        if any(gpu < 0 for gpu in group.gpus):
            out.error(f"{field}.gpus", "GPU ids are >= 0")


def _check_batching(config: Any, out: _Collector) -> None:
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        if config.max_batch_size == 0:
            out.warning("dynamic_batching", "has no effect with max_batch_size 0")
        for size in batching.preferred_batch_size:
            if size < 1 or (config.max_batch_size and size > config.max_batch_size):
                out.error(
                    "dynamic_batching.preferred_batch_size",
                    f"{size} must be between 1 and max_batch_size ({config.max_batch_size})",
                )
    if config.HasField("sequence_batching"):
        kinds: set[int] = set()
        for index, control_input in enumerate(config.sequence_batching.control_input):
            field = f"sequence_batching.control_input[{control_input.name or index}]"
            if not control_input.name:
                out.error(field, "a control input needs a name")
            for control in control_input.control:
                kind_name = Control.Kind.Name(control.kind)
                if control.kind in kinds:
                    out.error(field, f"{kind_name} is given more than once")
                kinds.add(control.kind)
                pairs = [
                    len(control.int32_false_true),
                    len(control.fp32_false_true),
                    len(control.bool_false_true),
                ]
                if control.kind == Control.Kind.CONTROL_SEQUENCE_CORRID:
                    if control.data_type not in (
                        model_config_pb2.TYPE_UINT64,
                        model_config_pb2.TYPE_INT64,
                        model_config_pb2.TYPE_UINT32,
                        model_config_pb2.TYPE_INT32,
                        model_config_pb2.TYPE_STRING,
                    ):
                        out.error(
                            field, f"{kind_name} needs data_type INT32/64, UINT32/64 or STRING"
                        )
                elif sorted(pairs) != [0, 0, 2]:
                    out.error(
                        field,
                        f"{kind_name} needs exactly one of int32_false_true, fp32_false_true or "
                        "bool_false_true, with two values",
                    )


def _check_version_policy(config: Any, out: _Collector) -> None:
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "latest" and policy.latest.num_versions < 1:
        out.error("version_policy.latest.num_versions", "must be >= 1")
    if which == "specific":
        if not policy.specific.versions:
            out.error("version_policy.specific.versions", "lists no version")
        if any(v < 1 for v in policy.specific.versions):
            out.error("version_policy.specific.versions", "versions are integers >= 1")


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "error"]
