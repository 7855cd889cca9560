"""Triton's perf_analyzer, run against one node: a model's explicit version measured at each
concurrency of a range, every figure as perf_analyzer reports it (throughput, latency
percentiles, and the server's own queue and compute time per request). It sends its own requests
(a load generator in C++, not the product's client): what a performance gate measures before
traffic, a fixed number of requests per concurrency that Triton's counters read back."""

import csv
import io
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

OUTPUT_TAIL = 600  # characters of perf_analyzer's own words kept in an error


class PerfError(Exception):
    """perf_analyzer could not measure: it is missing, failed, or ran out of time. Says which
    node and model, and perf_analyzer's last words."""


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
    input_data: Path | None = None,
    streaming: bool = False,
    timeout_s: float = 120.0,
) -> list[Point]:
    """`version` of `model` on the node at `grpc_url` (host:port), at each concurrency of
    (start, end, step), `requests` requests at each (perf_analyzer counts requests one
    concurrency a run); `timeout_s` a run. `input_data`: perf_analyzer's JSON of the model's own
    inputs (random ones otherwise); `streaming` for a decoupled model."""
    where = f"{node or grpc_url}: {model} v{version}"
    start, end, step = concurrencies
    command = [
        settings.PERF_ANALYZER,
        *("-m", model, "-x", str(version), "-u", grpc_url, "-i", "grpc"),
        *("--request-count", str(requests), "--max-trials", "1"),
        *("--input-data", str(input_data) if input_data else "random"),
        *(["--streaming"] if streaming else []),
    ]
    with tempfile.TemporaryDirectory(prefix="perf-") as tmp:
        return [
            _run(
                [*command, "--concurrency-range", str(n)], Path(tmp) / f"{n}.csv", where, timeout_s
            )
            for n in range(start, end + 1, step)
        ]


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


def _points(text: str, where: str) -> list[Point]:
    """perf_analyzer's CSV report (times in microseconds), a row per concurrency."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise PerfError(f"{where}: perf_analyzer reported no measurement")
    try:
        return [
            Point(
                concurrency=int(row["Concurrency"]),
                throughput=float(row["Inferences/Second"]),
                p50_ms=float(row["p50 latency"]) / 1000,
                p90_ms=float(row["p90 latency"]) / 1000,
                p99_ms=float(row["p99 latency"]) / 1000,
                queue_us=float(row["Server Queue"]),
                compute_us=sum(
                    float(row[f"Server Compute {part}"]) for part in ("Input", "Infer", "Output")
                ),
            )
            for row in rows
        ]
    except (KeyError, ValueError) as exc:
        raise PerfError(f"{where}: perf_analyzer's report is not as expected: {exc}") from None
