"""Prometheus' file_sd list of the local fleet's nodes: one line each (a YAML list whose items
are JSON objects), with `node` and `pool` labels and the ports of the node's HTTP and gRPC
endpoints, which the control plane's discovery reads from Prometheus' targets API. A node comes
as one line appended; otherwise the file is replaced whole, never seen half-written."""

import json
from collections.abc import Iterable
from pathlib import Path

from apps.devtools.processes import Proc, write_whole


def write(path: Path, nodes: Iterable[Proc], pool: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, "".join(f"{_line(node, pool)}\n" for node in nodes))


def add(path: Path, node: Proc, pool: str) -> None:
    with path.open("a") as listed:
        listed.write(f"{_line(node, pool)}\n")


def drop(path: Path, name: str) -> None:
    """The node's target gone from the list."""
    kept = [line for line in _lines(path) if _labels(line)["node"] != name]
    write_whole(path, "".join(f"{line}\n" for line in kept))


def listed(path: Path, pool: str) -> list[str]:
    """The pool's nodes in the list, in order."""
    return [labels["node"] for labels in map(_labels, _lines(path)) if labels["pool"] == pool]


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line] if path.exists() else []


def _line(node: Proc, pool: str) -> str:
    labels = {"node": node.name, "pool": pool}
    labels |= {"http_port": str(node.ports["http"]), "grpc_port": str(node.ports["grpc"])}
    return "- " + json.dumps({"targets": [f"127.0.0.1:{node.ports['metrics']}"], "labels": labels})


def _labels(line: str) -> dict[str, str]:
    return json.loads(line.removeprefix("- "))["labels"]
