"""Side-by-side line diff of two configs, in their canonical pbtxt form."""

import difflib
from dataclasses import dataclass
from typing import Any

from apps.registry.codec import from_dict, to_pbtxt


@dataclass(frozen=True)
class Row:
    kind: str  # equal, replace, delete, insert
    left_no: int | None
    left: str
    right_no: int | None
    right: str


def config_diff(left: dict[str, Any], right: dict[str, Any]) -> list[Row]:
    """Two stored configs, each in its canonical pbtxt form, side by side."""
    return side_by_side(to_pbtxt(from_dict(left)), to_pbtxt(from_dict(right)))


def side_by_side(left: str, right: str) -> list[Row]:
    a, b = left.splitlines(), right.splitlines()
    rows = []
    for kind, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        for offset in range(max(i2 - i1, j2 - j1)):
            i, j = i1 + offset, j1 + offset
            rows.append(
                Row(
                    kind=kind,
                    left_no=i + 1 if i < i2 else None,
                    left=a[i] if i < i2 else "",
                    right_no=j + 1 if j < j2 else None,
                    right=b[j] if j < j2 else "",
                )
            )
    return rows
