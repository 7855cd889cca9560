"""Evaluation cases from JSON Lines, checked against the model's config the way Triton would
check the request: every input named and typed as declared, of the declared dims."""

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from apps.fleet.triton import numpy_dtype
from apps.quality.rules import RuleError, parse_rule

MAX_CASES = 10_000
MAX_BYTES = 20 * 2**20  # a set
MAX_LINE_BYTES = 2**20  # a case
MAX_PROBLEMS = 100  # then reading stops: fix these first
KEYS = {"name", "inputs", "expect"}


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # as Triton's inference protocol names it: FP32, INT64, BYTES...
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    batched: bool  # max_batch_size > 0: every request carries a batch dimension first

    @classmethod
    def of(cls, config: dict[str, Any]) -> "Signature":
        def tensors(key: str) -> dict[str, Tensor]:
            return {
                t["name"]: Tensor(
                    t["name"],
                    _DATATYPES.get(t.get("data_type", ""), t.get("data_type", "")[5:]),
                    tuple(int(d) for d in t.get("dims", [])),
                )
                for t in config.get(key, [])
            }

        return cls(tensors("input"), tensors("output"), int(config.get("max_batch_size", 0)) > 0)


# Triton's config names a string tensor TYPE_STRING, its protocol BYTES; the rest drop "TYPE_".
_DATATYPES = {"TYPE_STRING": "BYTES"}


@dataclass(frozen=True)
class Case:
    line: int
    name: str
    inputs: dict[str, Any]
    expect: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Problem:
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = [f"line {self.line}"] if self.line else []
        return ": ".join([*where, *([self.field] if self.field else []), self.message])


def parse_cases(
    lines: Iterable[str | bytes], signature: Signature
) -> tuple[list[Case], list[Problem]]:
    """Every case of JSON Lines, or every problem with its line and field: a set is stored whole
    or not at all, so an error anywhere refuses it. Read a line at a time (an upload's bytes as
    they come, never the whole file at once); past MAX_BYTES, or MAX_PROBLEMS, reading stops."""
    cases: list[Case] = []
    problems: list[Problem] = []
    names: dict[str, int] = {}
    size = 0
    for number, raw in enumerate(lines, 1):
        size += (length := len(raw) if isinstance(raw, bytes) else len(raw.encode()))
        if size > MAX_BYTES:
            problems.append(Problem(number, "", f"the set is larger than {MAX_BYTES // 2**20} MiB"))
            break
        if length > MAX_LINE_BYTES:
            problems.append(Problem(number, "", f"a case is at most {MAX_LINE_BYTES // 2**20} MiB"))
        elif (line := _text(number, raw)) is None:
            problems.append(Problem(number, "", "not UTF-8 text"))
        elif not line.strip():
            continue
        elif len(cases) == MAX_CASES:
            problems.append(Problem(number, "", f"more than {MAX_CASES} cases"))
            break
        elif isinstance(found := _case(number, line, signature), Case):
            if found.name in names:
                problems.append(
                    Problem(number, "name", f"{found.name!r} is already line {names[found.name]}")
                )
            names.setdefault(found.name, number)
            cases.append(found)
        else:
            problems += found
        if len(problems) >= MAX_PROBLEMS:
            problems.append(Problem(number, "", f"{len(problems)} problems: reading stopped here"))
            break
    if not cases and not problems:
        return [], [Problem(1, "", "no cases: one JSON object per line is expected")]
    return (cases, []) if not problems else ([], problems)


def _text(number: int, line: str | bytes) -> str | None:
    """A line as text without its end (None: not UTF-8); a file's byte order mark dropped."""
    if isinstance(line, str):
        return line.rstrip("\r\n")
    try:
        return line.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        return None


def _case(number: int, line: str, signature: Signature) -> Case | list[Problem]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return [Problem(number, "", f"not JSON: {exc.msg} at column {exc.colno}")]
    except RecursionError:
        return [Problem(number, "", "nested deeper than a case can be")]
    if not isinstance(raw, dict):
        return [Problem(number, "", "a case is a JSON object with inputs and expect")]
    if "\\u0000" in json.dumps(raw).replace("\\\\", ""):
        return [Problem(number, "", "a NUL character (\\u0000), which no case may hold")]
    problems = [
        Problem(number, key, "unknown key; known: name, inputs, expect")
        for key in sorted(set(raw) - KEYS)
    ]
    name = raw.get("name", f"line {number}")
    if not isinstance(name, str) or not name.strip() or len(name) > 120:
        problems.append(Problem(number, "name", "a case's name is a text of 1 to 120 characters"))
    inputs, expect = raw.get("inputs"), raw.get("expect")
    if not isinstance(inputs, dict):
        problems.append(Problem(number, "inputs", "an object of input tensors by name"))
        inputs = {}
    if not isinstance(expect, dict) or not expect:
        problems.append(Problem(number, "expect", "an object of output tensors and their rules"))
        expect = {}
    for tensor in signature.inputs.values():
        if tensor.name not in inputs:
            problems.append(Problem(number, f"inputs.{tensor.name}", "missing"))
    for key, value in inputs.items():
        declared = signature.inputs.get(key)
        if declared is None:
            known = ", ".join(signature.inputs) or "none"
            problems.append(
                Problem(number, f"inputs.{key}", f"no such input; the model's: {known}")
            )
            continue
        try:
            as_array(value, declared)
        except ValueError as exc:
            problems.append(Problem(number, f"inputs.{key}", str(exc)))
    rules: dict[str, dict[str, Any]] = {}
    for key, rule in expect.items():
        if key not in signature.outputs:
            known = ", ".join(signature.outputs) or "none"
            problems.append(
                Problem(number, f"expect.{key}", f"no such output; the model's: {known}")
            )
            continue
        try:
            rules[key] = parse_rule(rule, where=f"expect.{key}")
        except RuleError as exc:
            field, _, message = str(exc).partition(": ")
            problems.append(Problem(number, field, message))
    if problems:
        return problems
    return Case(number, str(name).strip(), inputs, rules)


def as_array(value: Any, tensor: Tensor) -> np.ndarray:
    """The value as the tensor's numpy array, without its batch dimension; ValueError says what
    does not match. A lone value stands for a tensor of dims [1]."""
    if not isinstance(value, list) and len(tensor.dims) == 1 and tensor.dims[0] in (1, -1):
        value = [value]
    try:
        array = np.array(value, dtype=np.object_ if tensor.datatype == "BYTES" else None)
    except ValueError:
        raise ValueError("ragged: every row of a tensor has the same length") from None
    if tensor.datatype == "BYTES":
        if array.dtype != np.object_ or not all(isinstance(v, str) for v in array.flat):
            raise ValueError(f"{tensor.datatype} takes strings")
        array = np.vectorize(str.encode, otypes=[np.object_])(array) if array.size else array
    else:
        array = _typed(array, tensor)
    shape = tuple(array.shape)
    if len(shape) != len(tensor.dims) or any(
        d != -1 and d != s for d, s in zip(tensor.dims, shape, strict=False)
    ):
        dims = list(tensor.dims)
        raise ValueError(f"shape {list(shape)} does not match dims {dims}")
    return array


def _typed(array: np.ndarray, tensor: Tensor) -> np.ndarray:
    try:
        dtype = numpy_dtype(tensor.datatype)
    except (TypeError, KeyError):
        raise ValueError(f"type {tensor.datatype} is not supported here") from None
    kind = array.dtype.kind
    if tensor.datatype == "BOOL":
        ok = kind == "b"
    elif dtype.kind in "iu":
        ok = kind in "iu"
    else:
        ok = kind in "iuf"
    if not ok:
        shown = "strings" if kind in "UO" else f"{array.dtype} values"
        raise ValueError(f"{tensor.datatype} takes numbers, not {shown}")
    return array.astype(dtype)
