"""A traffic ramp on the trio, scaled by the local fleet's autoscaler on the product's signal
(tests/integration/test_autoscaling.py asserts it, tests/bench/test_autoscaling.py times it):
real Triton nodes behind a real HAProxy, found in a real Prometheus by the real worker and
beat, which compute the signal from the pool's request rate against its measured capacity."""

import time
from dataclasses import dataclass

from apps.devtools.autoscaler import Follower
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.fleet.models import Node, NodePool
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.scaling.hpa import Autoscaler
from apps.scaling.models import Scaling
from apps.scaling.services import scaling_set
from tests.support.fleet import answered_through, recording, runtime, wait_for
from tests.support.quality import perf_measured

WINDOW_S = 20  # the autoscaler's scale-down stabilization


def wanted() -> int | None:
    return Scaling.objects.filter(pool__name="trio").values_list("wanted", flat=True).first()


@dataclass(frozen=True)
class Ramp:
    asked_s: float  # from the ramp up to the signal asking for a fourth node
    served_s: float  # ... to the fourth node answering users
    let_go_s: float  # from the autoscaler's decision to the node drained and stopped
    sent: int  # the users' requests, all answered


def ramp(scaling: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]) -> Ramp:
    """Up to four nodes under 7 requests/s (2 a node measured); back to three under 1 a second
    once a paused rollout on the fourth has ended (none goes while it runs); no request fails."""
    devfleet, _ = trio
    pipeline = Model.objects.get(name="rag_pipeline")
    perf_measured(pipeline, 1, rate=2.0)  # 2 requests a second a node, within the budget
    scaling_set(pool_name="trio", least=3, most=4, actor="system:test")
    follower = Follower(
        devfleet, "trio", Autoscaler(least=3, most=4, scale_down_window_s=WINDOW_S, tolerance=0)
    )
    through = f"http://127.0.0.1:{haproxy.ports['http']}"
    clock = time.monotonic()

    with recording(through, rps=7) as users:  # 7 / (2 x 0.8) a node: 5, at most 4
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
    sent = len(users.sent)

    rollout = Rollout.objects.create(  # paused on its canary node: it holds the pool
        model=pipeline,
        pool=scaling,
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
            lambda: Scaling.objects.filter(pool=scaling, held__startswith="rollout").exists(),
            timeout=30,
        )
        time.sleep(12)  # the quiet window is read: the load alone asks for 1
        said = follower.step(clock + WINDOW_S + 1)
        assert said == "trio: 4 wanted, 4 nodes: steady", said
        assert follower.listed() == ["trio-1", "trio-2", "trio-3", "trio-4"]

        Rollout.objects.filter(pk=rollout.pk).update(state=Rollout.State.SUCCEEDED)
        try:
            wait_for("the signal lets a node go", lambda: wanted() == 3, timeout=30)
        except AssertionError:
            print(
                Scaling.objects.filter(pool=scaling)
                .values_list("wanted", "reasons", "held")
                .first()
            )
            raise
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
    return Ramp(asked, joined, let_go, sent + len(users.sent))
