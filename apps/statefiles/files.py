"""A pool's desired state as YAML: read with the line of every value (a bad file names where it
is wrong), written stable and sorted for review. No database here: `state.py` reads and
`services.py` applies."""

from dataclasses import dataclass
from typing import Any

import yaml

# A pool's file, key by key, in the order it is written.
HEADER = (
    "# The desired state of pool {pool}: manage.py desired diff shows what differs from the\n"
    "# control plane's database; manage.py desired apply --commit <sha> makes it match.\n"
)
TRAFFIC = ("strategy", "runtime", "backends", "min_serving", "warmup_requests", "drain_timeout_s")
KEYS = (
    "pool",
    "protected",
    "discoverable",
    "queue",
    "rollback_window_s",
    "traffic",
    "scaling",
    "deployments",
    "tiers",
)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    file: str
    line: int  # 1-based; 0: the whole file
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.field + ': ' if self.field else ''}{self.message}"


class FilesError(Exception):
    """Files that cannot be applied: every problem, each with its file, line and field."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.problems = problems


@dataclass
class Parsed:
    file: str
    state: dict[str, Any]
    lines: dict[Path, int]

    def line(self, *path: str | int) -> int:
        """The line of the value at `path`, or of the nearest key above it."""
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def problem(self, path: Path, message: str) -> Problem:
        field = ".".join(str(part) for part in path)
        return Problem(self.file, self.line(*path), field, message)


def load(file: str, text: str) -> Parsed:
    """A file's state, with the line of each value; malformed YAML raises FilesError at its
    line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        reason = getattr(exc, "problem", None) or str(exc)
        raise FilesError([Problem(file, line, "", f"not YAML: {reason}")]) from None
    if node is None:
        raise FilesError([Problem(file, 0, "", "empty: a pool's file has `pool:` at least")])
    constructor = yaml.SafeLoader("")
    try:
        value = constructor.construct_document(node)
    except yaml.YAMLError as exc:  # a tag or value YAML cannot build
        raise FilesError(
            [Problem(file, node.start_mark.line + 1, "", f"not YAML: {exc}")]
        ) from None
    if not isinstance(value, dict):
        raise FilesError([Problem(file, 1, "", "a pool's file is a mapping of its settings")])
    lines: dict[Path, int] = {}
    _lines(node, (), lines)
    return Parsed(file, value, lines)


def _lines(node: yaml.Node, path: Path, lines: dict[Path, int]) -> None:
    """The line of every value under `node`, by its path of keys and indices."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, item in node.value:
            _lines(item, (*path, str(key.value)), lines)
            lines[(*path, str(key.value))] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _lines(item, (*path, index), lines)


def dump(state: dict[str, Any]) -> str:
    """A pool's file: its keys in KEYS order, deployments and tiers sorted by model."""
    ordered = {key: state[key] for key in KEYS if key in state}
    body = yaml.safe_dump(ordered, sort_keys=False, default_flow_style=None, width=100)
    return HEADER.format(pool=state["pool"]) + body


def file_name(pool: str) -> str:
    return f"{pool}.yaml"
