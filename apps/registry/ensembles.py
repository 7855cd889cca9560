"""Ensemble wiring, checked the way Triton checks it when it loads an ensemble
(docs/user_guide/ensemble_models.md, architecture.md#ensemble-models, core's ensemble_utils.cc).

Every problem names the ensemble, the step (index and model) and the tensor involved.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apps.registry.codec import model_config_pb2
from apps.registry.validation import Problem, is_ensemble

LATEST = -1
NOT_DECOUPLED = "no decoupled model"


@dataclass(frozen=True)
class Resolved:
    """What a step's (model, version) pin resolves to: a config, or why there is none."""

    config: Any | None
    version: int | None = None
    reason: str = ""


Resolver = Callable[[str, int], Resolved]


class UnresolvedStep(ValueError):
    """A step whose pin resolves to no version; the message says why."""


def pinned_steps(
    config: Any, resolve: Resolver, *, nested: bool = False
) -> dict[tuple[str, int], Any]:
    """(model, version) -> config of each step an ensemble pins, a pin to the latest (-1)
    resolved through `resolve`: each once, in pipeline order, and with `nested` the steps of the
    ensembles among them after them. Empty for any other model. Raises UnresolvedStep."""
    found: dict[tuple[str, int], Any] = {}
    pending = [config]
    while pending:
        for step in pending.pop(0).ensemble_scheduling.step:
            resolved = resolve(step.model_name, step.model_version)
            if resolved.config is None or resolved.version is None:
                raise UnresolvedStep(resolved.reason)
            key = (step.model_name, resolved.version)
            if key not in found:  # also ends a cycle, which validation reports on its own
                found[key] = resolved.config
                if nested:
                    pending.append(resolved.config)
    return found


@dataclass(frozen=True)
class _Tensor:
    data_type: int
    dims: list[int]
    full: list[int]  # with the batch dimension when the model batches
    where: str

    @classmethod
    def of(cls, tensor: Any, max_batch_size: int, where: str) -> "_Tensor":
        dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
        full = [-1, *dims] if max_batch_size > 0 else dims
        return cls(tensor.data_type, dims, full, where)

    def fits(self, other: "_Tensor") -> bool:
        """Triton's rule (ensemble_utils.cc): the dims agree, or the full shapes do, so that one
        tensor can feed a batching and a non-batching model; -1 matches any size."""
        return _same_shape(self.dims, other.dims) or _same_shape(self.full, other.full)


def _same_shape(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _type_name(data_type: int) -> str:
    return str(model_config_pb2.DataType.Name(data_type))


def validate_ensemble(
    config: Any, resolve: Resolver, *, _path: tuple[str, ...] = ()
) -> list[Problem]:
    name = config.name
    problems: list[Problem] = []

    def error(field: str, message: str) -> None:
        problems.append(Problem("error", name, field, message))

    path = (*_path, name)
    produced = {
        t.name: _Tensor.of(t, config.max_batch_size, "ensemble input") for t in config.input
    }
    consumers: dict[str, list[str]] = {tensor: [] for tensor in produced}
    pending: list[tuple[str, Any, Any]] = []  # steps whose inputs are not all produced yet
    decoupled: dict[int, bool] = {}  # per resolved step

    for index, step in enumerate(config.ensemble_scheduling.step):
        label = f"step[{index}] ({step.model_name} v{step.model_version})"
        field = f"ensemble_scheduling.step[{index}]"
        if step.model_name in path:
            cycle = " -> ".join([*path[path.index(step.model_name) :], step.model_name])
            error(field, f"{label} makes a cycle of ensembles: {cycle}")
            continue
        resolved = resolve(step.model_name, step.model_version)
        if resolved.config is None:
            error(field, f"{label}: {resolved.reason}")
            continue
        model = resolved.config
        if is_ensemble(model):
            problems += validate_ensemble(model, resolve, _path=path)
        # A step that does not batch (max_batch_size 0) takes the batch dimension in its own
        # dims, so only the shapes have to agree; Triton accepts it (checked against 2.51).
        if 0 < model.max_batch_size < config.max_batch_size:
            error(
                f"{field}.max_batch_size",
                f"ensemble max_batch_size {config.max_batch_size} exceeds {label}'s "
                f"max_batch_size {model.max_batch_size}",
            )
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key in step.input_map:
            if key not in inputs:
                error(
                    f"{field}.input_map[{key}]",
                    f"{label} has no input '{key}' (it has {sorted(inputs)})",
                )
        for key in inputs:
            if key not in step.input_map and not inputs[key].optional:
                error(f"{field}.input_map", f"input '{key}' of {label} is not mapped")
        for key, tensor_name in step.output_map.items():
            if key not in outputs:
                error(
                    f"{field}.output_map[{key}]",
                    f"{label} has no output '{key}' (it has {sorted(outputs)})",
                )
                continue
            if tensor_name in produced:
                error(
                    f"{field}.output_map[{key}]",
                    f"ensemble tensor '{tensor_name}' is produced twice: by {label} and by "
                    f"{produced[tensor_name].where}",
                )
                continue
            produced[tensor_name] = _Tensor.of(outputs[key], model.max_batch_size, label)
            consumers.setdefault(tensor_name, [])
        decoupled[index] = _decoupled(model, resolve, path)
        pending.append((field, step, model))

    for field, step, model in pending:
        label = f"step ({step.model_name} v{step.model_version})"
        inputs = {t.name: t for t in model.input}
        for key, tensor_name in step.input_map.items():
            if key not in inputs:
                continue
            source = produced.get(tensor_name)
            if source is None:
                error(
                    f"{field}.input_map[{key}]",
                    f"tensor '{tensor_name}' for {label} is never produced",
                )
                continue
            consumers[tensor_name].append(label)
            wanted = _Tensor.of(inputs[key], model.max_batch_size, label)
            if wanted.data_type != source.data_type:
                error(
                    f"{field}.input_map[{key}]",
                    f"tensor '{tensor_name}' is {_type_name(source.data_type)} from "
                    f"{source.where} but input '{key}' of {label} expects "
                    f"{_type_name(wanted.data_type)}",
                )
            if not source.fits(wanted):
                error(
                    f"{field}.input_map[{key}]",
                    f"tensor '{tensor_name}' has shape {source.dims} from {source.where} but "
                    f"input '{key}' of {label} expects {wanted.dims}",
                )

    _check_order(config, error)
    _check_decoupled(config, decoupled, error)
    for tensor_name, tensor in {t.name: t for t in config.output}.items():
        source = produced.get(tensor_name)
        if source is None:
            error(
                f"output[{tensor_name}]", f"ensemble output '{tensor_name}' is produced by no step"
            )
            continue
        consumers[tensor_name].append("ensemble output")
        if tensor.data_type != source.data_type:
            error(
                f"output[{tensor_name}]",
                f"is {_type_name(tensor.data_type)} but {source.where} produces "
                f"{_type_name(source.data_type)}",
            )
        declared = _Tensor.of(tensor, config.max_batch_size, "ensemble output")
        if not source.fits(declared):
            error(
                f"output[{tensor_name}]",
                f"has shape {declared.dims} but {source.where} produces {source.dims}",
            )
    for tensor_name, users in consumers.items():
        if not users:
            error("ensemble_scheduling", f"ensemble tensor '{tensor_name}' is unused")
    return problems


def _check_order(config: Any, error: Callable[[str, str], None]) -> None:
    """Steps must form a DAG over tensors: report steps that wait on each other in a cycle."""
    available = {t.name for t in config.input}
    remaining = dict(enumerate(config.ensemble_scheduling.step))
    produced_by_any = {v for s in remaining.values() for v in s.output_map.values()} | available
    progress = True
    while remaining and progress:
        progress = False
        for index, step in list(remaining.items()):
            needed = {v for v in step.input_map.values() if v in produced_by_any}
            if needed <= available:
                available |= set(step.output_map.values())
                del remaining[index]
                progress = True
    for index, step in remaining.items():
        waiting = sorted({v for v in step.input_map.values() if v not in available})
        error(
            f"ensemble_scheduling.step[{index}]",
            f"step ({step.model_name}) waits on {waiting}, which depend on its outputs (a cycle)",
        )


def streams(config: Any, resolve: Resolver) -> bool:
    """Whether the model answers a request with a stream of responses (decoupled), as Triton
    decides it for an ensemble: from its steps."""
    return _decoupled(config, resolve, ())


def _decoupled(model: Any, resolve: Resolver, path: tuple[str, ...]) -> bool:
    """Triton sets an ensemble's model_transaction_policy from its steps (ValidateEnsembleConfig),
    whatever its config says: an ensemble over a decoupled step is a decoupled step."""
    if not is_ensemble(model):
        return bool(model.model_transaction_policy.decoupled)
    if model.name in path:  # a cycle is reported on its own
        return False
    steps = model.ensemble_scheduling.step
    inner = (resolve(s.model_name, s.model_version).config for s in steps)
    return any(c is not None and _decoupled(c, resolve, (*path, model.name)) for c in inner)


def _check_decoupled(
    config: Any, decoupled: dict[int, bool], error: Callable[[str, str], None]
) -> None:
    """Triton's rule (core's ensemble_utils.cc, ValidateEnsembleConfig): every tensor descends
    from the last decoupled step before it, or from none; a step, and the ensemble's outputs, may
    only take tensors of one descent, as a decoupled step answers a request any number of times
    and the responses of two could not be paired."""
    steps = config.ensemble_scheduling.step
    origin = {t.name: NOT_DECOUPLED for t in config.input}
    waiting = set(decoupled)  # steps that resolved; the others are reported already
    progress = True
    while progress:
        progress = False
        for index in sorted(waiting):
            step = steps[index]
            tensors = sorted(set(step.input_map.values()))
            if not all(t in origin for t in tensors):
                continue
            waiting.discard(index)
            progress = True
            label = f"step[{index}] ({step.model_name} v{step.model_version})"
            origins = {origin[t] for t in tensors}
            # Triton checks a step when it reaches its outputs: a step without any is never seen.
            if len(origins) > 1 and step.output_map:
                error(
                    f"ensemble_scheduling.step[{index}]",
                    f"{label} receives inputs originated from different decoupled models: "
                    + ", ".join(f"'{t}' from {origin[t]}" for t in tensors),
                )
                continue
            own = f"decoupled {label}" if decoupled[index] else next(iter(origins), NOT_DECOUPLED)
            for tensor in step.output_map.values():
                origin.setdefault(tensor, own)
    outputs = sorted(t.name for t in config.output)
    if all(t in origin for t in outputs) and len({origin[t] for t in outputs}) > 1:
        error(
            "output",
            "ensemble outputs originate from different decoupled models: "
            + ", ".join(f"'{t}' from {origin[t]}" for t in outputs),
        )
