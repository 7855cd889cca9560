"""An LLM step's series by meaning, whatever backend serves it: time to first token, time per
output token, output and prompt tokens, requests waiting and KV-cache use, each read from every
backend's own series at once (PromQL `or`), so that a chart, a budget check or a judge asks one
question of a pool whatever its nodes run: Triton's own first-response histogram, the vLLM
backend, TensorRT-LLM, or a Python model that exports vLLM's names through Triton's custom
metrics (with `model` and `version` labels of its own: Triton adds none to custom metrics)."""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    backend: str
    series: str  # a histogram's name, without `_bucket`
    scale: float = 1.0  # to milliseconds, tokens, or a share from 0 to 1
    match: str = ""  # label matchers of its own, before the chart's


TTFT, ITL, OUTPUT, PROMPT, WAITING, KV_CACHE = (
    "ttft",
    "itl",
    "output_tokens",
    "prompt_tokens",
    "waiting",
    "kv_cache",
)

# Each meaning and where each backend exports it (their sources: triton-inference-server/core
# src/metrics.cc, vllm_backend src/utils/metrics.py, TensorRT-LLM's custom_metrics_reporter):
# - Triton's first-response histogram (ms) is every model's, a decoupled one's first token; it
#   ships from Triton 2.52 and only with `--metrics-config histogram_latencies=true` (2.51,
#   the local fleet's, exports none with it: the demo's charts read the vLLM names its `llm`
#   model exports through Triton's custom metrics).
# - The vLLM backend's series carry `model` and `version` of their own; it exports no queue or
#   KV-cache gauge (Triton's pending count stands for the queue).
# - TensorRT-LLM has no time to first token or per token of its own (Triton's histogram covers
#   the first); its tokens are histograms of each request's lengths (their `_sum` counts).
SERIES: dict[str, list[Source]] = {
    TTFT: [
        Source("triton", "nv_inference_first_response_histogram_ms"),
        Source("vllm", "vllm:time_to_first_token_seconds", 1000),
    ],
    ITL: [Source("vllm", "vllm:time_per_output_token_seconds", 1000)],
    OUTPUT: [
        Source("vllm", "vllm:generation_tokens_total"),
        Source(
            "tensorrt_llm",
            "nv_llm_output_token_len_sum",
            match='response_metric_type="total_output_tokens",',
        ),
    ],
    PROMPT: [
        Source("vllm", "vllm:prompt_tokens_total"),
        Source(
            "tensorrt_llm",
            "nv_llm_input_token_len_sum",
            match='response_metric_type="total_input_tokens",',
        ),
    ],
    WAITING: [
        Source("tensorrt_llm", "nv_trt_llm_request_metrics", match='request_type="waiting",'),
        Source("triton", "nv_inference_pending_request_count"),
    ],
    KV_CACHE: [],  # TensorRT-LLM's blocks in use over all of them (`_kv_used`)
}


def _either(parts: list[str]) -> str:
    """Whichever backend's series answer, as one expression (of a higher precedence than any
    operator the caller puts beside it)."""
    return "(" + " or ".join(f"({part})" for part in parts) + ")"


def _each(meaning: str, query: Callable[[Source], str], more: list[str] | None = None) -> str:
    """`query` of each backend's series of `meaning`, scaled to its unit, as one expression."""
    parts = [
        q if s.scale == 1 else f"{q} * {s.scale:g}" for s in SERIES[meaning] if (q := query(s))
    ]
    return _either(parts + (more or []))


def quantile(meaning: str, q: float, *, selector: str, window: str, by: str) -> str:
    """The `q` quantile of a histogram meaning (ms), over the window, by `by`."""
    return _each(
        meaning,
        lambda s: (
            f"histogram_quantile({q:g}, sum by (le, {by}) "
            f"(rate({s.series}_bucket{{{s.match}{selector}}}[{window}])))"
        ),
    )


def mean(meaning: str, *, selector: str, window: str, by: str) -> str:
    """A histogram meaning's mean (ms) over the window, by `by`."""
    return _each(
        meaning,
        lambda s: (
            f"sum by ({by}) (rate({s.series}_sum{{{s.match}{selector}}}[{window}])) / "
            f"sum by ({by}) (rate({s.series}_count{{{s.match}{selector}}}[{window}]))"
        ),
    )


def per_second(meaning: str, *, selector: str, window: str, by: str) -> str:
    """A counter meaning's rate, by `by`."""
    return _each(
        meaning, lambda s: f"sum by ({by}) (rate({s.series}{{{s.match}{selector}}}[{window}]))"
    )


def now(meaning: str, *, selector: str, by: str) -> str:
    """A gauge meaning, its highest by `by`; the KV cache from TensorRT-LLM's blocks as well."""
    more = [_kv_used(selector=selector, by=by)] if meaning == KV_CACHE else []
    return _each(meaning, lambda s: f"max by ({by}) ({s.series}{{{s.match}{selector}}})", more)


def _kv_used(*, selector: str, by: str) -> str:
    blocks = "nv_trt_llm_kv_cache_block_metrics"
    return (
        f'max by ({by}) ({blocks}{{kv_cache_block_type="used",{selector}}} / ignoring '
        f'(kv_cache_block_type) {blocks}{{kv_cache_block_type="max",{selector}}})'
    )


def sample_queries(*, selector: str, window: str) -> dict[str, str]:
    """Per node, one sample every `window`: the mean time to first token and per output token
    (ms), and output tokens per request."""
    requests = f"sum by (node) (rate(nv_inference_request_success{{{selector}}}[{window}]))"
    return {
        "time to first token": mean(TTFT, selector=selector, window=window, by="node"),
        "time per output token": mean(ITL, selector=selector, window=window, by="node"),
        "output tokens per request": (
            f"{per_second(OUTPUT, selector=selector, window=window, by='node')} / {requests}"
        ),
    }


def prompt_query(*, selector: str, window: str) -> str:
    """Per node, prompt tokens per request over the window: what a first token's time grows
    with."""
    requests = f"sum by (node) (rate(nv_inference_request_success{{{selector}}}[{window}]))"
    return f"{per_second(PROMPT, selector=selector, window=window, by='node')} / {requests}"


def buckets(meaning: str, *, selector: str, window: str) -> list[tuple[Source, str]]:
    """Each backend's histogram of `meaning` by node and bucket, its rate over the window: one
    query a backend, as their buckets' bounds are in their own units (`Source.scale` to ms)."""
    return [
        (s, f"sum by (node, le) (rate({s.series}_bucket{{{s.match}{selector}}}[{window}]))")
        for s in SERIES[meaning]
    ]
