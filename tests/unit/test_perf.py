"""perf_analyzer's report read, and what an unreadable one says (the runs themselves, against a
real node: tests/integration/test_perf.py)."""

import pytest

from apps.fleet.perf import PerfError, Point, _points

HEADER = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
    "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
    "p50 latency,p90 latency,p95 latency,p99 latency"
)


def test_a_report_reads_as_one_point_per_concurrency_in_milliseconds() -> None:
    text = f"{HEADER}\n2,812.5,10,200,150,20,900,30,5,2100,2600,2800,3900\n"
    assert _points(text, "n1: embedder v1") == [
        Point(2, 812.5, p50_ms=2.1, p90_ms=2.6, p99_ms=3.9, queue_us=150.0, compute_us=950.0)
    ]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "n1: embedder v1: perf_analyzer reported no measurement"),
        (f"{HEADER}\n", "n1: embedder v1: perf_analyzer reported no measurement"),
        ("Concurrency,Inferences/Second\n1,812\n", "report is not as expected: 'p50 latency'"),
        (f"{HEADER}\n1,fast,1,1,1,1,1,1,1,1,1,1,1\n", "not as expected: could not convert"),
    ],
)
def test_an_unreadable_report_says_so(text: str, said: str) -> None:
    with pytest.raises(PerfError, match=said):
        _points(text, "n1: embedder v1")
