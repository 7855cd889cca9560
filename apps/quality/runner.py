"""Cases sent through Triton itself: each to an explicit version on one node, a bounded number
at a time, each within its own timeout; their answers as JSON values, to be judged and stored."""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from apps.fleet import asking
from apps.fleet.triton import TritonClient
from apps.quality.cases import Signature, as_array


@dataclass(frozen=True)
class Answer:
    outputs: dict[str, Any] | None  # as JSON values, without the batch dimension
    latency_ms: float | None
    error: str = ""
    first_ms: float | None = None  # a streamed answer's first token
    tokens: int | None = None  # a streamed answer's


def request(inputs: dict[str, Any], signature: Signature) -> dict[str, np.ndarray]:
    """A case's inputs as a request of batch 1 (a batched model's first dimension)."""
    arrays = {name: as_array(value, signature.inputs[name]) for name, value in inputs.items()}
    return {name: a[np.newaxis] if signature.batched else a for name, a in arrays.items()}


def ask(
    client: TritonClient,
    *,
    model: str,
    version: int,
    requests: list[dict[str, np.ndarray]],
    batched: bool,
    concurrency: int,
    timeout_s: float,
) -> list[Answer]:
    """One answer per request, in their order, its outputs as JSON values; sent the one way
    every feature asks a node (apps/fleet/asking.py)."""
    return [
        Answer(
            None
            if answer.outputs is None
            else {k: jsonable(v, batched) for k, v in answer.outputs.items()},
            answer.latency_ms,
            answer.error,
            answer.first_ms,
            None if answer.first_ms is None else answer.responses,
        )
        for answer in asking.ask(
            [client],
            model,
            requests,
            version=version,
            concurrency=concurrency,
            timeout_s=timeout_s,
        )
    ]


def jsonable(array: np.ndarray, batched: bool) -> Any:
    """An output as a JSON value: the batch dimension dropped, bytes as text."""
    value = array[0] if batched and array.ndim else array
    return _plain(value.tolist() if isinstance(value, np.ndarray) else value)


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def storable(value: Any) -> Any:
    """NaN and infinities as null: JSON has none, and PostgreSQL refuses them."""
    if isinstance(value, list):
        return [storable(v) for v in value]
    if isinstance(value, dict):
        return {k: storable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
