"""A real Prometheus over a TSDB written by `promtool tsdb create-blocks-from openmetrics`."""

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

Row = tuple[str, str, float, bool]  # name, labels, per second (a counter) or its value


def gpu_memory(readings: dict[tuple[str, str], tuple[int, int, range]]) -> str:
    """Triton's GPU memory series in OpenMetrics, for `backfilled_prometheus`: for each (node,
    GPU uuid) of pool `gpu`, its bytes in use and in all at each second of its range."""
    lines = []
    for name in ("nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"):
        lines += [f"# HELP {name} GPU memory, in bytes", f"# TYPE {name} gauge"]
        for (node, uuid), (used, total, times) in readings.items():
            value = used if name.endswith("used_bytes") else total
            lines += [
                f'{name}{{gpu_uuid="{uuid}",node="{node}",pool="gpu"}} {value} {t}' for t in times
            ]
    return "\n".join(lines) + "\n# EOF\n"


# Per node and second: requests, and per request ms waiting and computing; pending now.
PIPELINE_STEPS = {
    "embedder": (40, 0.5, 2.0, 0),
    "retriever": (40, 0.5, 3.0, 0),
    "reranker": (40, 40.0, 10.0, 3),
    "generator": (40, 1.0, 8.0, 0),
    "rag_pipeline": (40, 0.0, 0.0, 0),  # the ensemble's own: Triton says it never queues
}


def pipeline_steps(times: range) -> str:
    """rag_pipeline's steps' counters on nodes gpu-1 and gpu-2 of pool gpu, as PIPELINE_STEPS
    says, at each of `times`, for `backfilled_prometheus`: the reranker queues."""
    rows: list[Row] = []
    for node in ("gpu-1", "gpu-2"):
        rows.append(
            ("nv_gpu_utilization", f'gpu_uuid="{node}-0",node="{node}",pool="gpu"', 0.3, False)
        )
        for model, (rate, queue_ms, compute_ms, pending) in PIPELINE_STEPS.items():
            labels = f'model="{model}",node="{node}",pool="gpu",version="1"'
            rows += [
                ("nv_inference_request_success", labels, rate, True),
                ("nv_inference_count", labels, rate, True),
                ("nv_inference_exec_count", labels, rate, True),
                ("nv_inference_queue_duration_us", labels, rate * queue_ms * 1000, True),
                ("nv_inference_compute_input_duration_us", labels, 0, True),
                ("nv_inference_compute_infer_duration_us", labels, rate * compute_ms * 1000, True),
                ("nv_inference_compute_output_duration_us", labels, 0, True),
                ("nv_inference_pending_request_count", labels, pending, False),
            ]
    return _openmetrics(rows, times)


def _openmetrics(rows: list[Row], times: range) -> str:
    """Each row at each of `times`: a counter grown by its rate since the first."""
    lines = []
    for name in dict.fromkeys(name for name, *_ in rows):
        lines += [f"# HELP {name} backfilled", f"# TYPE {name} gauge"]
        lines += [
            f"{name}{{{labels}}} {value * (t - times[0]) if counter else value} {t}"
            for each, labels, value, counter in rows
            if each == name
            for t in times
        ]
    return "\n".join(lines) + "\n# EOF\n"


@contextmanager
def backfilled_prometheus(root: Path, openmetrics: str | Iterable[str]) -> Iterator[str]:
    """Yields the URL of a Prometheus that holds exactly `openmetrics` (ending with `# EOF`),
    given whole or as lines (streamed to disk: a fleet's series do not fit a string well)."""
    with (root / "input.om").open("w") as written:
        written.writelines([openmetrics] if isinstance(openmetrics, str) else openmetrics)
    data = root / "data"
    promtool = shutil.which("promtool") or "promtool"
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(root / "input.om"), str(data)],
        check=True,
        capture_output=True,
    )
    (root / "prometheus.yml").write_text("global: {scrape_interval: 15s}\nscrape_configs: []\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1):  # noqa: S310 - localhost
                    break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(20)


# Per node and second, on pool gpu: requests, and each one's first token, tokens and time per
# token. "generator" v3 exports the vLLM backend's names; "trtllm" v1 is TensorRT-LLM's, its first
# token in Triton's own histogram.
LLM_REQUESTS = 10
TTFT_S, ITL_S, GENERATOR_TOKENS = 0.2, 0.02, 100  # generator: first tokens all in (0.1, 0.3]
GENERATOR_COMPUTE_S = 0.5  # a request's compute, its batch's counted on each
TRT_TTFT_MS, TRT_TOKENS = 300, 200  # trtllm: first tokens all in (100, 500]


def _histogram(rows: list[Row], name: str, labels: str, buckets: list[float], value: float) -> None:
    """LLM_REQUESTS a second, each observed at `value`."""
    for le in [*map(str, buckets), "+Inf"]:
        inside = le == "+Inf" or value <= float(le)
        rows.append((f"{name}_bucket", f'{labels},le="{le}"', LLM_REQUESTS * inside, True))
    rows.append((f"{name}_sum", labels, LLM_REQUESTS * value, True))
    rows.append((f"{name}_count", labels, LLM_REQUESTS, True))


def llm_series(times: range) -> str:
    """LLM series of two backends in OpenMetrics, for `backfilled_prometheus`."""
    rows: list[Row] = []

    def histogram(name: str, labels: str, buckets: list[float], value: float) -> None:
        _histogram(rows, name, labels, buckets, value)

    for node in ("gpu-1", "gpu-2"):
        where = f'node="{node}",pool="gpu"'
        vllm = f'model="generator",{where},version="3"'
        histogram("vllm:time_to_first_token_seconds", vllm, [0.1, 0.3, 0.5, 1.0], TTFT_S)
        histogram("vllm:time_per_output_token_seconds", vllm, [0.01, 0.025, 0.05], ITL_S)
        rows.append(("vllm:generation_tokens_total", vllm, LLM_REQUESTS * GENERATOR_TOKENS, True))
        rows.append(("nv_inference_request_success", vllm, LLM_REQUESTS, True))
        rows.append(("nv_inference_count", vllm, LLM_REQUESTS, True))
        rows.append(("nv_inference_exec_count", vllm, LLM_REQUESTS, True))
        compute_us = LLM_REQUESTS * GENERATOR_COMPUTE_S * 1e6
        rows.append(("nv_inference_compute_infer_duration_us", vllm, compute_us, True))
        trt = f'model="trtllm",{where},version="1"'
        histogram("nv_inference_first_response_histogram_ms", trt, [100, 500, 2000], TRT_TTFT_MS)
        tokens = f'{trt},response_metric_type="total_output_tokens"'
        histogram("nv_llm_output_token_len", tokens, [10, 50, 100, 500], TRT_TOKENS)
        rows.append(("nv_inference_request_success", trt, LLM_REQUESTS, True))
        rows.append(("nv_trt_llm_request_metrics", f'{trt},request_type="waiting"', 3, False))
        for kind, blocks in (("used", 600), ("max", 1000)):
            labels = f'kv_cache_block_type="{kind}",{trt}'
            rows.append(("nv_trt_llm_kv_cache_block_metrics", labels, blocks, False))
    return _openmetrics(rows, times)


# rag_pipeline v10 on nodes trio-1 and trio-2 of pool trio: its own P99 labelled version "1", as
# Triton labels every ensemble version; its steps' with their true versions; llm 1's first tokens
# all in (0.1, 0.25] s and 6 ms a token after them.
STREAMING_P99_MS = {
    ("rag_pipeline", 1): 420.0,
    ("embedder", 2): 4.0,
    ("retriever", 2): 9.0,
    ("reranker", 2): 6.0,
    ("llm", 1): 390.0,
}


def streaming_pipeline(times: range) -> str:
    """The demo's streaming pipeline as Triton and its `llm` export it, for
    `backfilled_prometheus`."""
    rows: list[Row] = []
    for node in ("trio-1", "trio-2"):
        where = f'node="{node}",pool="trio"'
        for (model, version), p99_ms in STREAMING_P99_MS.items():
            labels = f'model="{model}",{where},quantile="0.99",version="{version}"'
            rows.append(("nv_inference_request_summary_us", labels, p99_ms * 1000, False))
        llm = f'model="llm",{where},version="1"'
        _histogram(rows, "vllm:time_to_first_token_seconds", llm, [0.1, 0.25, 0.5], 0.11)
        _histogram(rows, "vllm:time_per_output_token_seconds", llm, [0.005, 0.01, 0.025], 0.006)
    return _openmetrics(rows, times)
