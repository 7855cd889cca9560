"""Nodes joining on their own, on the trio of real Triton nodes behind a real HAProxy, found in a
real Prometheus' targets API (file_sd) by the real worker and beat: JOINS nodes started one after
another while users send 10 requests/s through HAProxy.

Reported: for each, the time from Prometheus' targets API listing it to HAProxy giving it its
full weight (found, HAProxy server added at weight 0, rag_pipeline v1's five models loaded, read
back READY, warmed); asserted: none took traffic while it joined, none of the users' requests
failed.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_discovery.py -s -p no:cacheprovider`
"""

import statistics

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from tests.support.bench import Report
from tests.support.fleet import join_watched, recording

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

JOINS = 3


def test_time_from_a_targets_listing_to_serving(
    discovering: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState], report: Report
) -> None:
    devfleet, _ = trio
    with recording(f"http://127.0.0.1:{haproxy.ports['http']}", rps=10) as users:
        joined = [join_watched(devfleet, haproxy, "trio") for _ in range(JOINS)]
    took = [round(each.listed_to_serving_s, 1) for each in joined]
    bench = "a node joins on its own"
    report.add(bench, "listed -> serving, median (s)", f"{statistics.median(took):.1f}", "")
    report.add(bench, f"each of {JOINS} (s)", ", ".join(map(str, took)), "")
    report.add(bench, "failed requests", f"{users.failed} of {len(users.sent)}", "0")
    assert all(set(each.weights_while_joining) <= {None, 0} for each in joined)
    assert users.failed == 0
