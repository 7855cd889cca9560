"""A pool scaled on the product's signal as a cluster scales it (tests/support/autoscaling.py):
on the trio behind a real HAProxy, users ramp to 7 requests/s (a node measured at 2), the
signal asks for a fourth node, the local fleet's autoscaler (an HPA's arithmetic) starts it and
it joins; during a rollout the ramp down lets no node go; after it one is drained and stopped.

Reported: the time from the ramp to the ask and to the fourth node serving users, and from the
autoscaler's scale-in to the node drained and stopped; asserted: no request failed.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_autoscaling.py -s -p no:cacheprovider`
"""

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from tests.support.autoscaling import ramp
from tests.support.bench import Report

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_ramp_up_and_down_on_the_signal(
    scaling: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState], report: Report
) -> None:
    timed = ramp(scaling, haproxy, trio)
    bench = "a pool follows its signal"
    report.add(bench, "ramp -> a fourth node asked (s)", f"{timed.asked_s:.1f}", "")
    report.add(bench, "ramp -> it serves users (s)", f"{timed.served_s:.1f}", "")
    report.add(bench, "scale-in -> drained, stopped (s)", f"{timed.let_go_s:.1f}", "")
    report.add(bench, "failed requests", f"0 of {timed.sent}", "0")
