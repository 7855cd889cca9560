"""The rules an evaluation case checks one output tensor against, and the scores they give.

Outputs arrive as JSON-like values, converted from numpy with the batch dimension stripped, so
a dims [1] tensor is a one-element list. Scores are stored as JSON: a value is never NaN or
infinite (it is None instead).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

_KINDS = ("exact", "contains", "close_to", "top_k", "cosine", "agrees")
_AGREES = ("exact", "top_k", "cosine", "close_to")
_PARAMS = {
    "exact": (),
    "contains": ("ignore_case",),
    "close_to": ("abs", "rel"),
    "top_k": ("k", "key", "min"),
    "cosine": ("min",),
}
_SHORT = 120
_Floats = npt.NDArray[np.float64]


class RuleError(ValueError):
    """What is wrong with a rule, and where (the caller passes `where`, e.g. 'expect.SOURCE')."""


@dataclass(frozen=True)
class Score:
    passed: bool | None  # None: not applicable (an "agrees" rule with no baseline output)
    # 1.0/0.0 for exact and contains, the share found for top_k, the cosine, the worst
    # absolute/relative error for close_to; None where nothing could be measured.
    value: float | None
    detail: str  # empty when passed


MISSING = object()  # no baseline output was given


def parse_rule(raw: object, *, where: str) -> dict[str, Any]:
    """Checks one rule's JSON and returns it normalized (defaults filled in); the RuleError's
    message is `where`, ": ", then what is wrong (apps/quality/cases.py splits it there)."""
    if not isinstance(raw, dict):
        raise RuleError(
            f'{where}: a rule is a JSON object such as {{"exact": 1}}, not {_short(raw)}'
        )
    kinds = [key for key in raw if key in _KINDS]
    if len(kinds) != 1:
        found = " and ".join(f'"{key}"' for key in kinds or raw) or "nothing"
        raise RuleError(f"{where}: a rule has exactly one of {_quoted(_KINDS)}; got {found}")
    kind = kinds[0]
    compare = raw[kind] if kind == "agrees" else kind
    if kind == "agrees" and compare not in _AGREES:
        raise RuleError(f'{where}: "agrees" is one of {_quoted(_AGREES)}, not {_short(compare)}')
    for key in raw:
        if key != kind and key not in _PARAMS[compare]:
            label = kind if kind != "agrees" else f'agrees "{compare}"'
            allowed = _quoted(_PARAMS[compare]) or "nothing else"
            raise RuleError(f'{where}: unknown key "{key}"; {label} takes {allowed}')
    rule = {kind: compare if kind == "agrees" else _expected(kind, raw[kind], where)}
    if compare == "contains":
        rule["ignore_case"] = raw.get("ignore_case", False)
        if not isinstance(rule["ignore_case"], bool):
            raise RuleError(
                f'{where}: "ignore_case" is true or false, not {_short(rule["ignore_case"])}'
            )
    elif compare == "close_to":
        given = [key for key in ("abs", "rel") if key in raw]
        if len(given) > 1 or (not given and kind != "agrees"):
            raise RuleError(f'{where}: close_to takes one of "abs" or "rel" (not both)')
        tolerance = given[0] if given else "abs"
        rule[tolerance] = _number(raw, tolerance, 0.0, lambda x: x >= 0, ">= 0", where)
    elif compare == "top_k":
        k = raw.get("k", len(rule["top_k"]) if kind == "top_k" else 1)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise RuleError(f'{where}: "k" is an integer >= 1, not {_short(k)}')
        key = raw.get("key")
        if key is not None and not (isinstance(key, str) and key):
            raise RuleError(f'{where}: "key" is the name of a JSON field, not {_short(key)}')
        share = _number(raw, "min", 1.0, lambda x: 0 < x <= 1, "in (0, 1]", where)
        rule.update(k=k, key=key, min=share)
    elif compare == "cosine":
        rule["min"] = _number(raw, "min", 0.99, lambda x: -1 <= x <= 1, "in [-1, 1]", where)
    return rule


def needs_baseline(rule: dict[str, Any]) -> bool:
    return "agrees" in rule


def score(rule: dict[str, Any], output: Any, *, baseline: Any = MISSING) -> Score:
    """The output judged by one rule from parse_rule."""
    if output is None:  # the response lacked the tensor
        return Score(False, None, "no output")
    if "agrees" in rule:
        if baseline is MISSING:
            return Score(None, None, "no baseline to agree with")
        if baseline is None:
            return Score(None, None, "the baseline gave no output")
        kind, expected = rule["agrees"], baseline
        if kind == "top_k":
            expected = _ids(_ranked(baseline)[: rule["k"]], rule["key"])
    else:
        kind = next(key for key in _KINDS if key in rule)
        expected = rule[kind]
    if kind == "exact":
        return _exact(expected, output)
    if kind == "contains":
        return _contains(expected, output, ignore_case=rule["ignore_case"])
    if kind == "close_to":
        return _close_to(expected, output, rule)
    if kind == "top_k":
        return _top_k(expected, output, k=rule["k"], key=rule["key"], share=rule["min"])
    return _cosine(expected, output, least=rule["min"])


def _expected(kind: str, value: Any, where: str) -> Any:
    if kind == "contains" and not isinstance(value, str):
        raise RuleError(f'{where}: "contains" is a text, not {_short(value)}')
    if kind in ("close_to", "cosine"):
        array = _numbers(value)
        if array is None or not array.size or not np.isfinite(array).all():
            raise RuleError(
                f'{where}: "{kind}" is a number or a (nested) list of finite numbers, '
                f"not {_short(value)}"
            )
        if kind == "cosine" and not array.ndim:
            raise RuleError(f'{where}: "cosine" is a list of numbers, not {_short(value)}')
    if kind == "top_k":
        ids = _ids(value, None) if isinstance(value, list) else []
        if not ids or len(ids) != len(value) or len(set(ids)) != len(ids):
            raise RuleError(
                f'{where}: "top_k" is a list of distinct ids (texts), not {_short(value)}'
            )
        return ids
    return value


def _number(
    raw: dict[str, Any],
    key: str,
    default: float,
    ok: Callable[[float], bool],
    allowed: str,
    where: str,
) -> float:
    value = raw.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not ok(value):
        raise RuleError(f'{where}: "{key}" is a number {allowed}, not {_short(value)}')
    return float(value)


def _exact(expected: Any, output: Any) -> Score:
    # int and float compare by value (1 == 1.0), as JSON does not tell them apart.
    if _unwrapped(expected, output) == expected:
        return Score(True, 1.0, "")
    return Score(False, 0.0, f"expected {_short(expected)}, got {_short(output)}")


def _contains(text: str, output: Any, *, ignore_case: bool) -> Score:
    candidates = [output] if isinstance(output, str) else output if isinstance(output, list) else []
    fold: Callable[[str], str] = str.casefold if ignore_case else str
    if any(fold(text) in fold(c) for c in candidates if isinstance(c, str)):
        return Score(True, 1.0, "")
    return Score(False, 0.0, f"expected a text containing {_short(text)}, got {_short(output)}")


def _close_to(expected: Any, output: Any, rule: dict[str, Any]) -> Score:
    pair = _arrays(expected, _unwrapped(expected, output))
    if isinstance(pair, str):
        return Score(False, None, pair)
    want, got = pair
    if want.shape != got.shape:
        shapes = f"expected shape {list(want.shape)}, got shape {list(got.shape)}"
        return Score(False, None, shapes)
    error = np.abs(got - want)
    name = "abs" if "abs" in rule else "rel"
    if name == "rel":
        # An expected 0 allows no difference at all rather than dividing by zero.
        scale = np.abs(want)
        error = np.divide(error, scale, out=np.where(error == 0, 0.0, np.inf), where=scale != 0)
    worst = float(error.max(initial=0.0))
    value = worst if math.isfinite(worst) else None
    if worst <= rule[name]:
        return Score(True, value, "")
    detail = f"expected {_short(expected)} within {name} {rule[name]:g}, got {_short(output)}"
    return Score(False, value, f"{detail} (worst {name} error {worst:.3g})")


def _top_k(expected: list[str], output: Any, *, k: int, key: str | None, share: float) -> Score:
    want = list(dict.fromkeys(expected[:k]))
    got = _ids(_ranked(output)[:k], key)
    hits = len(set(want) & set(got))
    # Only an "agrees" rule can expect nothing: a baseline that ranked nothing agrees with an
    # output that ranked nothing.
    value = hits / len(want) if want else float(not got)
    if value >= share:
        return Score(True, value, "")
    return Score(False, value, f"expected {_short(want)} in the first {k}, got {_short(got)}")


def _cosine(expected: Any, output: Any, *, least: float) -> Score:
    pair = _arrays(expected, output)
    if isinstance(pair, str):
        return Score(False, None, pair)
    want, got = pair[0].ravel(), pair[1].ravel()
    if want.size != got.size:
        return Score(False, None, f"expected {want.size} values, got {got.size}")
    norms = float(np.linalg.norm(want) * np.linalg.norm(got))
    if not norms:
        which = "the output" if not got.any() else "the expected vector"
        return Score(False, None, f"{which} is all zeros: no direction to compare")
    # Rounding can put identical vectors a hair above 1.
    value = float(np.clip(np.dot(want, got) / norms, -1.0, 1.0))
    if value >= least:
        return Score(True, value, "")
    return Score(False, value, f"expected a cosine of at least {least:g}, got {value:.4f}")


def _arrays(expected: Any, output: Any) -> tuple[_Floats, _Floats] | str:
    """Both as float arrays, or what keeps them from being compared."""
    want, got = _numbers(expected), _numbers(output)
    if got is None:
        return f"expected numbers, got {_short(output)}"
    if not np.isfinite(got).all():
        return f"NaN or infinity in the output: {_short(output)}"
    # Rules are checked when parsed; only a baseline's output can be wrong here.
    if want is None or not np.isfinite(want).all():
        return f"the baseline output is not finite numbers: {_short(expected)}"
    return want, got


def _numbers(value: Any) -> _Floats | None:
    """A number or rectangular nested list of numbers as floats, else None."""
    try:
        array = np.asarray(value)
    except ValueError:  # ragged
        return None
    return array.astype(np.float64) if array.dtype.kind in "iuf" else None


def _unwrapped(expected: Any, output: Any) -> Any:
    """A dims [1] output is a one-element list: a scalar expectation means its element."""
    if not isinstance(expected, list | dict) and isinstance(output, list) and len(output) == 1:
        return output[0]
    return output


def _ranked(output: Any) -> list[Any]:
    return output if isinstance(output, list) else [output]


def _ids(elements: list[Any], key: str | None) -> list[str]:
    """The ids of ranked elements, leaving out those without one. With a key, each element is
    a JSON text (or object) and its `key` field is the id; ids may be numbers, read as text."""
    ids = []
    for element in elements:
        item = element
        if key is not None:
            if isinstance(item, str):
                try:
                    item = json.loads(item)
                except ValueError:
                    continue
            item = item.get(key) if isinstance(item, dict) else None
        if isinstance(item, str):
            ids.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            ids.append(str(item))
    return ids


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= _SHORT else text[: _SHORT - 1] + "…"
