"""The local fleet scaled as a cluster would scale it, on the product's signal: real Triton
nodes behind a real HAProxy, found in a real Prometheus by the real worker and beat, which
compute the signal from the pool's request rate against its measured capacity. A traffic ramp
makes it ask for a fourth node, which the autoscaler (an HPA's arithmetic) starts and which
joins warmed, with no failed request; during a rollout the ramp down lets no node go; after it,
a node is drained before it stops, with no failed request."""

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import NodePool
from tests.support.autoscaling import ramp

# Alone: five Triton nodes under a ramp of users load the host, and the requests a second it
# reads are what it scales on.
pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.django_db(transaction=True)]


def test_a_traffic_ramp_grows_the_pool_and_shrinks_it_drained_never_during_a_rollout(
    scaling: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    timed = ramp(scaling, haproxy, trio)
    print(f"\n{timed}")
