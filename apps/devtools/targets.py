"""Prometheus' file_sd list of the local fleet's nodes: one line each (a YAML list whose items
are JSON objects), with `node` and `pool` labels and the ports of the node's HTTP and gRPC
endpoints, which the control plane's discovery reads from Prometheus' targets API. Written
whole, never seen half-written."""

import json
from collections.abc import Iterable
from pathlib import Path

from apps.devtools.processes import Proc


def write(path: Path, nodes: Iterable[Proc], pool: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, "".join(f"{_line(node, pool)}\n" for node in nodes))


def add(path: Path, node: Proc, pool: str) -> None:
    with path.open("a") as listed:
        listed.write(f"{_line(node, pool)}\n")


def drop(path: Path, name: str) -> None:
    """The node's target gone from the list."""
    kept = [line for line in path.read_text().splitlines() if _labels(line)["node"] != name]
    write_whole(path, "".join(f"{line}\n" for line in kept))


def listed(path: Path, pool: str) -> list[str]:
    """The pool's nodes in the list, in order."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [labels["node"] for labels in map(_labels, lines) if labels["pool"] == pool]


def _line(node: Proc, pool: str) -> str:
    labels = {"node": node.name, "pool": pool}
    labels |= {"http_port": str(node.ports["http"]), "grpc_port": str(node.ports["grpc"])}
    return "- " + json.dumps({"targets": [f"127.0.0.1:{node.ports['metrics']}"], "labels": labels})


def _labels(line: str) -> dict[str, str]:
    return json.loads(line.removeprefix("- "))["labels"]


def write_whole(path: Path, text: str) -> None:
    """`path` replaced at once, never seen half-written by whoever reads it (Prometheus' file_sd,
    the demo models' fault file); the partial file's name matches neither's pattern."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
