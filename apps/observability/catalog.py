"""Named PromQL queries over Triton's own series (docs/user_guide/metrics.md), one per chart."""

from dataclasses import dataclass

from apps.observability.prometheus import escape_label


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    unit: str
    template: str  # {selector} is the label matcher, {window} the rate window


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
    ]
}


def build_query(
    metric: Metric, *, model: str = "", pool: str = "", node: str = "", window_s: int = 30
) -> str:
    matchers = [
        f'{name}="{escape_label(value)}"'
        for name, value in [("model", model), ("pool", pool), ("node", node)]
        if value
    ]
    return metric.template.format(selector=",".join(matchers), window=f"{window_s}s")


def step_for(seconds: float) -> int:
    """A step (s) that keeps a chart at a few hundred points at most."""
    return max(2, int(seconds // 300))
