"""Exact canary shares and drained loads on 3 real Triton nodes behind a real HAProxy (Debian's),
driven by the real worker and beat; requests counted by Triton's own per-version counters."""

import itertools
import random
from collections import Counter
from datetime import timedelta

import pytest
import tritonclient.grpc as grpcclient
from django.utils import timezone
from tritonclient.utils import np_to_triton_dtype

from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState, Proc
from apps.devtools.traffic import send_traffic
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.triton import TritonClient, sample_inputs
from apps.registry.models import ModelVersion
from apps.registry.services import version_set_status
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import release_rollback, rollout_abort
from tests.support.fleet import (
    ANALYSIS,
    HEALTHY,
    STEPS_V1,
    STEPS_V2,
    converged,
    counted,
    equal,
    ready_on,
    served,
    settled,
    traffic_to,
    wait_for,
    weights,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

State = Rollout.State
RECONCILE_INTERVAL_S = 2  # the test worker's beat (tests/support/services.py)


def through(haproxy: Proc, count: int) -> Counter[str]:
    """`count` unversioned rag_pipeline requests through HAProxy's HTTP frontend."""
    client = TritonClient(f"http://127.0.0.1:{haproxy.ports['http']}", node="haproxy")
    return send_traffic([client], model="rag_pipeline", rps=200, seconds=count / 200)


def start(pool: NodePool, plan: str) -> Rollout:
    return rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=2,
        plan=plan,
        analysis={**ANALYSIS, **HEALTHY},
        actor="release-manager",
    )


def test_loads_wait_their_turn_out_of_traffic_and_warm_up_before_it(
    weighted: NodePool, trio: tuple[Devfleet, FleetState]
) -> None:
    """min_serving 2 of 3: the nodes loaded v1 one at a time, each drained first; each answered
    its warm-up requests (nobody else sent any) before it took traffic again."""
    spans = []
    for node in weighted.nodes.all():
        drained = AuditEvent.objects.filter(action="node.drain", target=f"node:{node.name}")
        assert drained.filter(result="ok").count() == 1
        loads = Operation.objects.filter(node=node, status=Operation.Status.SUCCEEDED)
        assert loads.count() == len(STEPS_V1)
        spans.append((drained.get().created_at, max(op.finished_at for op in loads)))
    spans.sort()
    assert all(end <= following for (_, end), (following, _) in itertools.pairwise(spans))
    assert served(trio[1].nodes, trio[1], "rag_pipeline")[1] == 3 * 3


def test_grpc_clients_are_balanced_too(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    """One gRPC connection through HAProxy (HTTP/2): its requests are spread over the nodes,
    by Triton's own counters on each node, not all sent to the one the connection reached."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{haproxy.ports['grpc']}")
    metadata = client.get_model_metadata("rag_pipeline", as_json=True)
    spec = [(i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in metadata["inputs"]]
    nodes = trio[1].nodes
    before = [served([proc], trio[1], "rag_pipeline")[1] for proc in nodes]
    rng = random.Random(0)
    for _ in range(30):
        inputs = []
        for name, array in sample_inputs(spec, rng, texts=["where is my order"]).items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.infer("rag_pipeline", inputs)
    counted(nodes, trio[1], "rag_pipeline", 1, sum(before) + 30)
    after = [served([proc], trio[1], "rag_pipeline")[1] for proc in nodes]
    answered = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(answered) == 30 and min(answered) >= 5, answered


def test_a_rollback_inside_the_window_narrows_every_node_in_traffic_at_once(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    """Narrowing what a node serves loads nothing: no node leaves traffic or warms up again;
    v1 deprecated once v2 serves (routine) is still what on-call rolls back to."""
    deployment_set(
        model_name="rag_pipeline",
        version=2,
        pool=weighted,
        baseline=1,
        baseline_until=timezone.now() + timedelta(minutes=10),
        actor="system:test",
    )
    ops = Operation.objects.filter(node__pool=weighted)
    both = settled(weighted, STEPS_V1 | STEPS_V2)
    wait_for(
        "v2 beside v1 everywhere, every node back in traffic",
        lambda: both() and weights(haproxy) == equal(trio[1]),
    )
    v1 = ModelVersion.objects.get(model__name="rag_pipeline", version=1)
    version_set_status(version_id=v1.pk, status="deprecated", actor="release-manager")
    since = timezone.now()
    release_rollback(model_name="rag_pipeline", pool_name=weighted.name, actor="oncall")
    wait_for("v1 alone everywhere, its loads recorded", settled(weighted, STEPS_V1))
    rollback = AuditEvent.objects.get(action="release.rollback", created_at__gte=since)
    assert (rollback.result, rollback.after["version"]) == ("ok", 1)
    narrowed = ops.filter(created_at__gte=since)
    assert narrowed.exists() and not narrowed.exclude(status=Operation.Status.SUCCEEDED).exists()
    assert not AuditEvent.objects.filter(action="node.drain", created_at__gte=since).exists()
    assert weights(haproxy) == equal(trio[1])


def test_a_10_percent_step_gets_10_percent_of_requests_and_a_rollback_none(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    _, state = trio
    rollout = start(weighted, "10%, hold 10m\n100%")
    canary = "trio-1"  # the first node by name
    share = {name: 99 for name in equal(state)} | {canary: 22}  # 22 / (22 + 2 x 99) = 10 %

    def back_in_traffic() -> bool:
        """Loaded, warmed up and back (the share went out before the load did)."""
        serves = ("rag_pipeline", 2) in ready_on(Node.objects.get(name=canary))
        return serves and not Node.objects.get(name=canary).draining and weights(haproxy) == share

    wait_for("the canary is READY and back in traffic", back_in_traffic)
    assert Rollout.objects.get(pk=rollout.pk).canary_nodes == [canary]

    before = served(
        state.nodes, state, "embedder"
    )  # the step's own version says which release answered
    results = through(haproxy, 2000)
    after = counted(state.nodes, state, "embedder", None, sum(before.values()) + 2000)
    assert results == Counter({"haproxy ok": 2000})
    to_canary = after[2] - before[2]
    assert sum(after.values()) - sum(before.values()) == 2000
    assert 170 <= to_canary <= 230, f"{to_canary} of 2,000 requests reached v2"

    # HAProxy restarts with the weights of its configuration; the next reconcile restores them.
    killed = timezone.now()
    trio[0].kill("haproxy")
    trio[0].restart("haproxy")
    # One interval of the beat, and the moment a worker takes to run the task.
    wait_for("the weights are back", lambda: weights(haproxy) == share, RECONCILE_INTERVAL_S + 2)
    # HAProxy shows the weights inside the sync's transaction; its record follows the commit.
    drifts = AuditEvent.objects.filter(action="pool.traffic_drift", target="pool:trio")
    wait_for("the drift is recorded", drifts.filter(created_at__gte=killed).exists, 5)
    drift = drifts.get()  # the restart's alone: a drain's own change is never taken for drift
    assert drift.before["weights"] == equal(state) and drift.after["weights"] == share

    rollout_abort(rollout_id=rollout.pk, actor="release-manager")
    assert weights(haproxy) == share | {canary: 0}  # before anything else happens
    aborted = AuditEvent.objects.get(action="rollout.aborting")
    first, *_ = aborted.after["parts"]  # the canary's share went first, with the abort
    assert (first["action"], first["after"]["weights"]) == ("pool.set_weights", {canary: 0})
    cut = aborted.created_at
    wait_for(
        "rolled back",
        lambda: Rollout.objects.get(pk=rollout.pk).state == State.ROLLED_BACK,
        timeout=120,
    )
    # The canary node had no share from the abort until it was read back on v1 alone.
    after_abort = Operation.objects.filter(node__name=canary, created_at__gt=cut)
    assert after_abort.exists() and all(op.started_at > cut for op in after_abort)
    narrowed = after_abort.get(model_name="rag_pipeline", versions=[1])
    back = AuditEvent.objects.get(action="pool.set_weights", created_at__gt=cut)
    assert back.after["weights"][canary] == 100
    assert narrowed.finished_at and back.created_at > narrowed.finished_at
    wait_for("equal shares again", lambda: weights(haproxy) == equal(state))


def test_a_rollout_by_5_25_50_100_percent_completes(
    weighted: NodePool, haproxy: Proc, trio: tuple[Devfleet, FleetState]
) -> None:
    with traffic_to(trio[1], through=f"http://127.0.0.1:{haproxy.ports['http']}", rps=20):
        rollout = start(weighted, "5%, hold 5s\n25%, hold 5s\n50%, hold 5s\n100%")
        wait_for(
            "the rollout ends",
            lambda: Rollout.objects.get(pk=rollout.pk).state not in Rollout.ACTIVE,
            timeout=300,
        )
    rollout = Rollout.objects.get(pk=rollout.pk)
    assert rollout.state == State.SUCCEEDED, rollout.reason
    steps = AuditEvent.objects.filter(action="pool.set_weights", target="pool:trio").order_by("id")
    assert [event.after["weights"] for event in steps] == [
        {"trio-1": 10, "trio-2": 95, "trio-3": 95},  # 5 %: 10 / (10 + 2 x 95)
        {"trio-1": 66, "trio-2": 99, "trio-3": 99},  # 25 %: 66 / (66 + 2 x 99)
        {"trio-1": 50, "trio-2": 50, "trio-3": 100},  # 50 %: 2 x 50 / (2 x 50 + 100)
        {"trio-1": 100, "trio-2": 100},  # 100 %
    ]
    wait_for("v2 alone on every node", converged(weighted, STEPS_V2), timeout=60)
