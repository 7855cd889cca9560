"""Every PromQL query over Triton's own series (docs/user_guide/metrics.md): one per chart, the
overview's tiles, the step breakdown, a rollout's analysis and the GPUs' room for a load. It
imports no other app: every app may use it, as it may the Prometheus client."""

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from apps.prometheus import llm
from apps.prometheus.client import escape_label


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    unit: str
    template: str  # {selector} is the label matcher, {window} the rate window


def _llm(build: Callable[..., str]) -> str:
    """An LLM meaning's query (apps/prometheus/llm.py) as a template, {selector} and {window}
    left to fill."""
    query = build(selector="\0s", window="\0w")
    braces = query.replace("{", "{{").replace("}", "}}")
    return braces.replace("\0s", "{selector}").replace("\0w", "{window}")


VERSIONS = "model, version"
REQUESTS = "sum by (model, version) (rate(nv_inference_request_success{{{selector}}}[{window}]))"
# GPU-seconds a second of a model's compute: compute per execution (Triton counts a batch's time
# on each of its requests: x executions / inferences).
COMPUTE = (
    "sum by (model, version) "
    "(rate(nv_inference_compute_infer_duration_us{{{selector}}}[{window}])) / 1e6"
    " * sum by (model, version) (rate(nv_inference_exec_count{{{selector}}}[{window}]))"
    " / sum by (model, version) (rate(nv_inference_count{{{selector}}}[{window}]))"
)
OUTPUT_TOKENS = _llm(partial(llm.per_second, llm.OUTPUT, by=VERSIONS))
METRICS = {
    m.key: m
    for m in [
        # A quantile cannot be averaged across nodes: the worst node's P99 is the fleet's bound.
        Metric(
            "p99",
            "P99 latency",
            "ms",
            "max by (model, version) "
            '(nv_inference_request_summary_us{{quantile="0.99",{selector}}}) / 1000',
        ),
        # Per node: how a rollout's canary nodes compare with the rest. (Triton 2.51 labels an
        # ensemble's own metrics version="1" whatever version served, so a version overlay
        # cannot show an ensemble's canary: the Metrics page says so under such a chart.)
        Metric(
            "p99_nodes",
            "P99 latency per node",
            "ms",
            'max by (node) (nv_inference_request_summary_us{{quantile="0.99",{selector}}}) / 1000',
        ),
        Metric(
            "throughput",
            "Throughput",
            "requests/s",
            "sum by (model, version) (rate(nv_inference_request_success{{{selector}}}[{window}]))",
        ),
        Metric(
            "batch",
            "Average batch size",
            "requests/execution",
            "sum by (model, version) (rate(nv_inference_count{{{selector}}}[{window}]))"
            " / sum by (model, version) (rate(nv_inference_exec_count{{{selector}}}[{window}]))",
        ),
        Metric(
            "errors",
            "Failed requests",
            "requests/s",
            "sum by (model, version, reason) "
            "(rate(nv_inference_request_failure{{{selector}}}[{window}]))",
        ),
        # What a model's requests cost its GPUs (COMPUTE) per 1,000 requests. A tuning release
        # shows here what it saved.
        Metric(
            "cost",
            "Compute per 1,000 requests",
            "GPU-seconds",
            f"{COMPUTE} / {REQUESTS} * 1000",
        ),
        Metric(
            "gpu_util",
            "GPU utilization",
            "%",
            "avg by (node) (nv_gpu_utilization{{{selector}}}) * 100",
        ),
        Metric(
            "gpu_memory",
            "GPU memory used",
            "GiB",
            "sum by (node, gpu_uuid) (nv_gpu_memory_used_bytes{{{selector}}}) / 1073741824",
        ),
        Metric(
            "cpu_memory",
            "CPU memory used",
            "GiB",
            "sum by (node) (nv_cpu_memory_used_bytes{{{selector}}}) / 1073741824",
        ),
        # An LLM step, as users feel it and as it costs, whatever backend serves it.
        Metric(
            "ttft_p99",
            "Time to first token, P99",
            "ms",
            _llm(partial(llm.quantile, llm.TTFT, 0.99, by=VERSIONS)),
        ),
        Metric(
            "ttft_p50",
            "Time to first token, P50",
            "ms",
            _llm(partial(llm.quantile, llm.TTFT, 0.5, by=VERSIONS)),
        ),
        Metric(
            "ttft_nodes",
            "Time to first token, P99 per node",
            "ms",
            _llm(partial(llm.quantile, llm.TTFT, 0.99, by="node")),
        ),
        Metric(
            "itl",
            "Time per output token (ITL)",
            "ms",
            _llm(partial(llm.mean, llm.ITL, by=VERSIONS)),
        ),
        Metric(
            "output_tokens",
            "Output tokens per second",
            "tokens/s",
            OUTPUT_TOKENS,
        ),
        Metric(
            "answer_tokens",
            "Output tokens per request",
            "tokens",
            f"{OUTPUT_TOKENS} / {REQUESTS}",
        ),
        # What an LLM step's answers cost its GPUs per 1,000 tokens, as "cost" per request.
        Metric(
            "cost_tokens",
            "Compute per 1,000 output tokens",
            "GPU-seconds",
            f"{COMPUTE} / {OUTPUT_TOKENS} * 1000",
        ),
        Metric(
            "llm_waiting",
            "Requests waiting for the LLM",
            "requests",
            _llm(lambda selector, window: llm.now(llm.WAITING, selector=selector, by="node")),
        ),
        Metric(
            "kv_cache",
            "KV-cache use",
            "%",
            _llm(lambda selector, window: llm.now(llm.KV_CACHE, selector=selector, by="node"))
            + " * 100",
        ),
    ]
}


def _selector(*, model: str = "", pool: str = "", node: str = "") -> str:
    return ",".join(
        f'{name}="{escape_label(value)}"'
        for name, value in [("model", model), ("pool", pool), ("node", node)]
        if value
    )


def nodes_matcher(nodes: list[str]) -> str:
    """The label matcher of exactly these nodes."""
    names = "|".join(re.escape(name) for name in sorted(nodes))
    return f'node=~"{escape_label(names)}"'


def gpu_memory_query(nodes: list[str], max_age_s: float) -> str:
    """Each GPU of these nodes: its memory in all and in use, where Prometheus read it within
    `max_age_s` (an instant query alone would answer with readings up to 5 minutes old)."""
    selector = nodes_matcher(nodes)
    return (
        f'{{__name__=~"nv_gpu_memory_(total|used)_bytes",{selector}}} and on (node, gpu_uuid) '
        f"(time() - timestamp(nv_gpu_memory_used_bytes{{{selector}}}) < {max_age_s:g})"
    )


def build_query(
    metric: Metric, *, model: str = "", pool: str = "", node: str = "", window_s: int = 30
) -> str:
    selector = _selector(model=model, pool=pool, node=node)
    return metric.template.format(selector=selector, window=f"{window_s}s")


def step_for(seconds: float) -> int:
    """A step (s) that keeps a chart at a few hundred points at most."""
    return max(2, int(seconds // 300))


# The overview's live tiles --------------------------------------------------------------------

TILE_WINDOW = "1m"


def _rate_by_model(counter: str) -> str:
    return f"sum by (model) (rate({counter}[{TILE_WINDOW}]))"


def served_rate_by_model() -> str:
    """Requests per second that succeeded, per model."""
    return _rate_by_model("nv_inference_request_success")


def failed_rate_by_model() -> str:
    """Requests per second that failed, per model."""
    return _rate_by_model("nv_inference_request_failure")


CAPACITY_WINDOW = "5m"


def pool_rates_query(pool: str) -> str:
    """Requests per second each model of `pool` served, over the last CAPACITY_WINDOW."""
    selector = _selector(pool=pool)
    return f"sum by (model) (rate(nv_inference_request_success{{{selector}}}[{CAPACITY_WINDOW}]))"


# The step breakdown ---------------------------------------------------------------------------

BREAKDOWN_WINDOW = "5m"


def worst_p99_query(models: list[str]) -> str:
    """The worst P99 (ms) over the last few minutes and all nodes, per model and version, for all
    `models` in one query."""
    pattern = escape_label("|".join(re.escape(m) for m in models))
    return (
        f'max by (model, version) (max_over_time(nv_inference_request_summary_us{{quantile="0.99",'
        f'model=~"{pattern}"}}[{BREAKDOWN_WINDOW}])) / 1000'
    )


# A rollout's analysis: the same queries for the canary and the baseline ---------------------


def canary_queries(*, model: str, pool: str, window_s: int) -> dict[str, str]:
    """Per node: requests that succeeded and failed in the window, worst P99 (ms)."""
    selector, window = _selector(model=model, pool=pool), f"{window_s}s"
    return {
        "ok": f"sum by (node) (increase(nv_inference_request_success{{{selector}}}[{window}]))",
        "failed": f"sum by (node) (increase(nv_inference_request_failure{{{selector}}}[{window}]))",
        # The summary's P99 averaged over the window: one slow scrape does not decide alone.
        "p99": "max by (node) (avg_over_time(nv_inference_request_summary_us"
        f'{{quantile="0.99",{selector}}}[{window}])) / 1000',
    }


QUEUE_SLICE_S = 10


def budget_queries(
    *, model: str, steps: list[str], pool: str, nodes: list[str], window_s: int
) -> dict[str, str]:
    """What a degradation trigger judges, one window at a time: the pool's requests of the model
    in the window, those that failed and those Triton rejected (a queue full), its worst node's
    P99 (ms) averaged over the window, the time its requests and its `steps`' waited in queues
    and computed (us), the median over the window of their ratio a QUEUE_SLICE_S slice at a time
    (a burst of a few seconds, whose queues dwarf every other second's, does not move it: the
    long view held), and each one's first tokens' P99 (ms: an LLM's, whatever backend). Every
    version of the model at once: Triton labels all of an ensemble's versions alike. Only
    `nodes`, those that serve the pool's users: a cold, drained or quarantined node, or a stray
    target labelled with the pool, is not what users feel."""
    window = f"{window_s}s"
    where = f"{_selector(pool=pool)},{nodes_matcher(nodes)}"
    selector = f"{where},{_selector(model=model)}"
    names = "|".join(re.escape(name) for name in sorted({model, *steps}))
    chain = f'{where},model=~"{escape_label(names)}"'
    return {
        "ok": f"sum(increase(nv_inference_request_success{{{selector}}}[{window}]))",
        "failed": f"sum(increase(nv_inference_request_failure{{{selector}}}[{window}]))",
        "p99": "max(avg_over_time(nv_inference_request_summary_us"
        f'{{quantile="0.99",{selector}}}[{window}])) / 1000',
        "rejected": "sum(increase(nv_inference_request_failure"
        f'{{{selector},reason="REJECTED"}}[{window}]))',
        "queue_us": f"sum(increase(nv_inference_queue_duration_us{{{chain}}}[{window}]))",
        "compute_us": f"sum(increase(nv_inference_compute_infer_duration_us{{{chain}}}[{window}]))",
        "queue_held": (
            f"quantile_over_time(0.5, (sum(increase(nv_inference_queue_duration_us{{{chain}}}"
            f"[{QUEUE_SLICE_S}s])) / sum(increase(nv_inference_compute_infer_duration_us"
            f"{{{chain}}}[{QUEUE_SLICE_S}s])))[{window}:{QUEUE_SLICE_S}s])"
        ),
        "ttft": llm.quantile(llm.TTFT, 0.99, selector=chain, window=window, by="model"),
    }


def quantiles_query(*, model: str, pool: str, window_s: int) -> str:
    """Each quantile of Triton's request-duration summary averaged over the window (us), by
    node and quantile."""
    selector, window = _selector(model=model, pool=pool), f"{window_s}s"
    return (
        "max by (node, quantile) "
        f"(avg_over_time(nv_inference_request_summary_us{{{selector}}}[{window}]))"
    )


def step_mean_latency_query(*, step: str, pool: str, window_s: int) -> str:
    """Mean latency (ms) per version over the window, from counters: unlike a summary's P99,
    which keeps a freshly loaded version's first slow requests for as long as its own age window,
    it forgets them with the window."""
    selector, window = _selector(model=step, pool=pool), f"{window_s}s"
    return (
        f"sum by (version) (increase(nv_inference_request_duration_us{{{selector}}}[{window}]))"
        f" / sum by (version) (increase(nv_inference_request_success{{{selector}}}[{window}]))"
        " / 1000"
    )


# A template's own (custom) series, per side: the same text with each side's nodes and version.
PLACEHOLDERS = ("pool", "nodes", "version", "window")


def custom_query(
    template: str, *, pool: str, nodes: list[str], version: int | None, window_s: int
) -> str:
    """`template` with `$pool`, `$nodes` (a regex matching exactly these nodes), `$version` and
    `$window` filled in, escaped for a double-quoted label value. One pass: text put in is never
    read again as a placeholder."""
    values = {
        "pool": escape_label(pool),
        "nodes": escape_label("|".join(re.escape(n) for n in sorted(nodes))),
        "version": "" if version is None else str(version),
        "window": f"{window_s}s",
    }
    return re.sub(rf"\$({'|'.join(PLACEHOLDERS)})\b", lambda m: values[m[1]], template)


def tuning_queries(*, pipeline: str, step: str) -> dict[str, str]:
    """What a tuning release of `step` is judged by beside latency, as templates of the
    analysis's own metrics (one query per side, `$nodes` that side's nodes): the pipeline's
    requests served per second and node, and the step's mean queue time per request (ms)."""

    def on_side(model: str) -> str:
        return f'model="{escape_label(model)}",pool="$pool",node=~"$nodes"'

    served = f"nv_inference_request_success{{{on_side(pipeline)}}}"

    def step_increase(counter: str) -> str:
        return f"sum(increase({counter}{{{on_side(step)}}}[$window]))"

    return {
        "throughput": f"sum(rate({served}[$window])) / count(count by (node) ({served}))",
        "queue": f"{step_increase('nv_inference_queue_duration_us')}"
        f" / {step_increase('nv_inference_request_success')} / 1000",
    }


def sample_queries(*, model: str, pool: str, step_s: int) -> dict[str, str]:
    """Per node, one sample every `step_s` (which must hold two scrapes at least): mean latency
    (ms) and error ratio from counters, which forget the past, unlike a summary's quantiles."""
    selector, window = _selector(model=model, pool=pool), f"{step_s}s"

    def rate(counter: str) -> str:
        return f"sum by (node) (rate({counter}{{{selector}}}[{window}]))"

    ok, failed = rate("nv_inference_request_success"), rate("nv_inference_request_failure")
    return {
        "latency": f"{rate('nv_inference_request_duration_us')} / {ok} / 1000",
        "error_ratio": f"{failed} / ({ok} + {failed})",
    }


def first_token_buckets(*, model: str, pool: str, window_s: int) -> list[tuple[llm.Source, str]]:
    """A model's first tokens by node and bucket over the window, a query per backend."""
    selector = _selector(model=model, pool=pool)
    return llm.buckets(llm.TTFT, selector=selector, window=f"{window_s}s")


def kv_cache_query(*, model: str, pool: str) -> str:
    """An LLM step's KV cache in use now (a share), its fullest per node, whatever backend."""
    return llm.now(llm.KV_CACHE, selector=_selector(model=model, pool=pool), by="node")


def prompt_sample_query(*, model: str, pool: str, step_s: int) -> str:
    """An LLM step's prompt tokens per request by node, a sample every `step_s`, as
    `llm_sample_queries`: the buckets its first tokens are compared within."""
    return llm.prompt_query(selector=_selector(model=model, pool=pool), window=f"{step_s}s")


def llm_sample_queries(*, model: str, pool: str, step_s: int) -> dict[str, str]:
    """An LLM step's samples by node, as `sample_queries` (apps/prometheus/llm.py): its first
    token, each token after it and its answers' length, whatever backend serves it."""
    return llm.sample_queries(selector=_selector(model=model, pool=pool), window=f"{step_s}s")


# An incident's suspects: the series each change is judged by ----------------------------------


def suspect_queries(*, model: str, pool: str) -> dict[str, str]:
    """A model's worst P99 (ms), its error ratio (failed / all requests) and, an LLM's, its time
    to first token's P99 (ms, whatever backend), in a pool."""
    selector = _selector(model=model, pool=pool)
    failed = f"sum(rate(nv_inference_request_failure{{{selector}}}[30s]))"
    served = f"sum(rate(nv_inference_request_success{{{selector}}}[30s]))"
    return {
        "p99": f'max(nv_inference_request_summary_us{{quantile="0.99",{selector}}}) / 1000',
        "errors": f"{failed} / ({served} + {failed})",
        "ttft": llm.quantile(llm.TTFT, 0.99, selector=selector, window="30s", by="model"),
    }


# Where a pipeline's time goes: its steps' counters, never the ensemble's own timings ---------

# Per step (by model): counters' increase over the window, and pending requests averaged over it.
STEP_MEASURES = {
    "requests": "nv_inference_request_success",
    "queue_us": "nv_inference_queue_duration_us",
    "input_us": "nv_inference_compute_input_duration_us",
    "infer_us": "nv_inference_compute_infer_duration_us",
    "output_us": "nv_inference_compute_output_duration_us",
    "inferences": "nv_inference_count",
    "executions": "nv_inference_exec_count",
}


def bottleneck_query(*, steps: list[str], pool: str, window_s: int) -> str:
    """One query, whatever the number of steps and nodes: each measure of STEP_MEASURES by model,
    pending requests and the nodes that served it by model, and the pool's GPUs' mean and peak
    utilization and memory (no model label), each series labelled with its `measure`."""
    names = escape_label("|".join(re.escape(name) for name in sorted(steps)))
    chain = f'{_selector(pool=pool)},model=~"{names}"'.lstrip(",")
    gpus, window = _selector(pool=pool), f"{window_s}s"
    parts = {
        measure: f"sum by (model) (increase({counter}{{{chain}}}[{window}]))"
        for measure, counter in STEP_MEASURES.items()
    } | {
        "pending": f"sum by (model) (avg_over_time(nv_inference_pending_request_count"
        f"{{{chain}}}[{window}]))",
        "nodes": "count by (model) (sum by (model, node) (increase(nv_inference_request_success"
        f"{{{chain}}}[{window}])) > 0)",
        "gpu_util": f"avg(avg_over_time(nv_gpu_utilization{{{gpus}}}[{window}]))",
        "gpu_util_peak": f"max(max_over_time(nv_gpu_utilization{{{gpus}}}[{window}]))",
        "gpu_used_bytes": f"sum(nv_gpu_memory_used_bytes{{{gpus}}})",
        "gpu_total_bytes": f"sum(nv_gpu_memory_total_bytes{{{gpus}}})",
    }
    return " or ".join(
        f'label_replace({expr}, "measure", "{measure}", "", "")' for measure, expr in parts.items()
    )


# The nodes each pool needs ----------------------------------------------------------------------


def scaling_query(window_s: int) -> str:
    """One query for every pool, whatever their number: per pool, model and version the requests,
    queue time and compute time a second (Triton's Kubernetes recipe's ratio, taken apart so that
    a step's batching delay can be set aside), and per pool the GPUs' mean utilization; each
    series labelled with its `measure`."""
    window = f"{window_s}s"
    parts = {
        measure: f"sum by (pool, model, version) (rate({counter}[{window}]))"
        for measure, counter in (
            ("rate", "nv_inference_request_success"),
            ("queue", "nv_inference_queue_duration_us"),
            ("compute", "nv_inference_compute_infer_duration_us"),
        )
    } | {"gpu": f"avg by (pool) (avg_over_time(nv_gpu_utilization[{window}]))"}
    return " or ".join(
        f'label_replace({expr}, "measure", "{measure}", "", "")' for measure, expr in parts.items()
    )
