"""The local fleet scaled as a cluster would scale it, on the product's signal: real Triton
nodes behind a real HAProxy, found in a real Prometheus by the real worker and beat, which
compute the signal from the pool's request rate against its measured capacity. A traffic ramp
makes it ask for a fourth node, which the autoscaler (an HPA's arithmetic) starts and which
joins warmed, with no failed request; during a rollout the ramp down lets no node go; after it,
a node is drained before it stops, with no failed request."""

import time

import pytest

from apps.devtools.autoscaler import Follower
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool
from apps.performance.models import PerfRun
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.scaling.hpa import Autoscaler
from apps.scaling.models import Scaling
from apps.scaling.services import scaling_set
from tests.support.fleet import answered_through, recording, runtime, wait_for
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

WINDOW_S = 20  # the autoscaler's scale-down stabilization


def wanted() -> int | None:
    return Scaling.objects.filter(pool__name="trio").values_list("wanted", flat=True).first()


def test_a_traffic_ramp_grows_the_pool_and_shrinks_it_drained_never_during_a_rollout(
    discovering: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState], celery: Celery
) -> None:
    devfleet, _ = trio
    celery.use_env(SCALING_TICK_S="1", SCALING_WINDOW_S="10")
    pipeline = Model.objects.get(name="rag_pipeline")
    measured = PerfRun.objects.create(  # as perf_analyzer measured it: 2 requests a second a node
        model=pipeline,
        version=1,
        node_name="trio-1",
        concurrencies=[1, 1, 1],
        requests=50,
        timeout_s=60,
        status=PerfRun.Status.DONE,
        requested_by="system:test",
    )
    measured.points.create(
        concurrency=1, throughput=2.0, p50_ms=1, p90_ms=1, p99_ms=1, queue_us=0, compute_us=0
    )
    scaling_set(pool_name="trio", least=3, most=4, actor="system:test")
    follower = Follower(
        devfleet, "trio", Autoscaler(least=3, most=4, scale_down_window_s=WINDOW_S, tolerance=0)
    )
    through = f"http://127.0.0.1:{haproxy.ports['http']}"
    clock = time.monotonic()

    with recording(through, rps=6) as users:  # 6 / (2 x 0.8) a node: 4 nodes
        began = time.monotonic()
        wait_for("the signal asks for 4 nodes", lambda: wanted() == 4, timeout=60)
        asked = time.monotonic() - began
        said = follower.step(clock)
        assert said.startswith("trio: 4 wanted, 3 -> 4: started ['trio-4']"), said
        wait_for(
            "trio-4 joins and answers users",
            lambda: (
                Node.objects.filter(name="trio-4", stage="serving").exists()
                and answered_through(haproxy, "trio-4") >= 5
            ),
            timeout=120,
        )
        joined = time.monotonic() - began
    assert users.failed == 0 and len(users.sent) > 30
    print(
        f"\nramp up: asked for 4 after {asked:.1f} s, the fourth node served after {joined:.1f} s"
    )

    rollout = Rollout.objects.create(  # paused on its canary node: it holds the pool
        model=pipeline,
        pool=discovering,
        baseline_version=1,
        canary_version=1,
        plan=[{"nodes": 1}, {"percent": 100}],
        state=Rollout.State.PAUSED,
        canary_nodes=["trio-4"],
        started_by="ann",
    )
    with recording(through, rps=1) as users:
        wait_for(
            "the signal holds at 4 for the rollout",
            lambda: Scaling.objects.filter(pool=discovering, held__startswith="rollout").exists(),
            timeout=30,
        )
        time.sleep(12)  # the quiet window is read: the load alone asks for 1
        said = follower.step(clock + WINDOW_S + 1)
        assert said == "trio: 4 wanted, 4 nodes: steady", said
        assert follower.listed() == ["trio-1", "trio-2", "trio-3", "trio-4"]

        Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.SUCCEEDED)
        wait_for("the signal lets a node go", lambda: wanted() == 3, timeout=30)
        began = time.monotonic()
        said = follower.step(clock + 2 * WINDOW_S + 2)
        let_go = time.monotonic() - began
        assert said.startswith("trio: 3 wanted, 4 -> 3: let go ["), said
        [gone] = set(follower.listed()) ^ {"trio-1", "trio-2", "trio-3", "trio-4"}
        # Drained before it stopped: out of HAProxy's rotation, read back.
        assert Node.objects.get(name=gone).served_weight == 0
        assert runtime(haproxy).weights("triton_http").get(gone) in (0, None)
        sent_after = len(users.sent)
        time.sleep(3)  # users keep going through HAProxy with the node stopped
    assert users.failed == 0 and len(users.sent) > sent_after
    print(f"ramp down: {gone} drained and stopped in {let_go:.1f} s")
