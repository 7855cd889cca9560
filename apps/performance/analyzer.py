"""Triton's perf_analyzer, run against one node: a model's explicit version measured at each
concurrency of a range, every figure as perf_analyzer reports it (throughput, latency
percentiles, and the server's own queue and compute time per request). It sends its own requests
(a load generator in C++, not the product's client): what a performance gate measures before
traffic, a fixed number of requests per concurrency that Triton's counters read back."""

import csv
import io
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

OUTPUT_TAIL = 600  # characters of perf_analyzer's own words kept in an error
MAX_POINTS = 8  # concurrencies in one measurement
RUN_LIMIT_S = 540  # a whole measurement, every concurrency: what a worker gives it


class PerfError(Exception):
    """perf_analyzer could not measure: it is missing, failed, or ran out of time. Says which
    node and model, and perf_analyzer's last words."""


class SearchError(Exception):
    """A search that cannot start, or cannot go on; says what and where."""


@dataclass(frozen=True)
class Point:
    """One concurrency's figures."""

    concurrency: int
    throughput: float  # inferences a second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    queue_us: float  # the server's queue time per request
    compute_us: float  # ... and its compute time (input, infer, output)


def perf_measure(
    *,
    grpc_url: str,
    model: str,
    version: int,
    concurrencies: tuple[int, int, int],
    requests: int,
    node: str = "",
    inputs: list[dict[str, Any]] | None = None,
    batched: bool = False,
    streaming: bool = False,
    timeout_s: float = 120.0,
) -> list[Point]:
    """`version` of `model` on the node at `grpc_url` (host:port), at each concurrency of
    (start, end, step), `requests` requests at each (perf_analyzer counts requests one
    concurrency a run); `timeout_s` a run. `inputs`: the model's own requests, as the registry
    keeps them (`Model.sample_inputs`, a batch of one each; `batched` when the model batches),
    random ones otherwise; `streaming` for a decoupled model."""
    where = f"{node or grpc_url}: {model} v{version}"
    start, end, step = concurrencies
    with tempfile.TemporaryDirectory(prefix="perf-") as tmp:
        data = Path(tmp) / "inputs.json"
        if inputs:
            data.write_text(json.dumps(input_data(inputs, batched=batched)))
        command = [
            settings.PERF_ANALYZER,
            *("-m", model, "-x", str(version), "-u", grpc_url, "-i", "grpc"),
            *("--request-count", str(requests), "--max-trials", "1"),
            *("--input-data", str(data) if inputs else "random"),
            *(["--streaming"] if streaming else []),
        ]
        return [
            _run(
                [*command, "--concurrency-range", str(n)], Path(tmp) / f"{n}.csv", where, timeout_s
            )
            for n in range(start, end + 1, step)
        ]


def concurrency_range(text: str, timeout_s: float) -> tuple[int, int, int]:
    """perf_analyzer's `start:end:step` (`4` and `1:4` too), checked: at most MAX_POINTS of
    them, each within `timeout_s`, inside RUN_LIMIT_S together."""
    parts = text.strip().split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 3:
        raise PerfError(f"{text!r} is not a concurrency range such as 4, 1:4 or 2:8:2")
    start, end, step = [*(numbers * 2)[:2], 1] if len(numbers) < 3 else numbers
    points = len(range(start, end + 1, step)) if start >= 1 and step >= 1 else 0
    if not 1 <= points <= MAX_POINTS or end < start:
        raise PerfError(f"{text!r}: from 1 up, {MAX_POINTS} concurrencies at most")
    if points * timeout_s > RUN_LIMIT_S:
        raise PerfError(
            f"{text!r}: {points} concurrencies of up to {timeout_s:g} s each may take longer than "
            f"a measurement's {RUN_LIMIT_S} s"
        )
    return start, end, step


def input_data(inputs: list[dict[str, Any]], *, batched: bool) -> dict[str, Any]:
    """Stored requests (Triton's JSON form: name -> datatype, shape, data) as perf_analyzer's
    `--input-data` file, sent in turn; a batching model's shapes without the batch dimension,
    which perf_analyzer adds."""
    return {
        "data": [
            {
                name: {
                    "content": tensor["data"],
                    "shape": tensor["shape"][1:] if batched else tensor["shape"],
                }
                for name, tensor in request.items()
            }
            for request in inputs
        ]
    }


def _run(command: list[str], report: Path, where: str, timeout_s: float) -> Point:
    try:
        done = subprocess.run(
            [*command, "-f", str(report)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        raise PerfError(f"{where}: no perf_analyzer at {command[0]!r}") from None
    except subprocess.TimeoutExpired:
        raise PerfError(f"{where}: perf_analyzer did not finish in {timeout_s:g} s") from None
    if done.returncode != 0 or not report.exists():
        said = (done.stdout + done.stderr).strip()
        first = said.splitlines()[0] if said else ""
        # A refused argument comes first, before the whole usage text.
        why = first if first.startswith("Error") else said[-OUTPUT_TAIL:]
        raise PerfError(f"{where}: perf_analyzer failed: {why}")
    (point,) = _points(report.read_text(), where)
    return point


# A request's mean latency as perf_analyzer's report splits it (microseconds): its parts add up.
LATENCY_PARTS = (
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
)


def _points(text: str, where: str) -> list[Point]:
    """perf_analyzer's CSV report (times in microseconds), a row per concurrency. Throughput is
    the concurrency over the mean latency (Little's law: each of the `concurrency` users sends
    its next request when the last is answered), the rate Triton's own counters read over the
    run; perf_analyzer's own "Inferences/Second" divides the requests by its whole run, its
    start and its end included (0.3 to 0.7 s here: a 2 s run reads a third too low)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise PerfError(f"{where}: perf_analyzer reported no measurement")
    try:
        found = []
        for row in rows:
            concurrency = int(row["Concurrency"])
            mean_us = sum(float(row[part]) for part in LATENCY_PARTS)
            if mean_us <= 0:
                raise ValueError(f"a mean latency of {mean_us:g} us")
            found.append(
                Point(
                    concurrency=concurrency,
                    throughput=concurrency / (mean_us / 1_000_000),
                    p50_ms=float(row["p50 latency"]) / 1000,
                    p90_ms=float(row["p90 latency"]) / 1000,
                    p99_ms=float(row["p99 latency"]) / 1000,
                    queue_us=float(row["Server Queue"]),
                    compute_us=sum(
                        float(row[f"Server Compute {part}"])
                        for part in ("Input", "Infer", "Output")
                    ),
                )
            )
        return found
    except (KeyError, ValueError) as exc:
        raise PerfError(f"{where}: perf_analyzer's report is not as expected: {exc}") from None
