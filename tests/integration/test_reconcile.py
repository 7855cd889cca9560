"""Desired state converged by the real worker and beat on 3 real Triton nodes."""

import os
import re
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.nodes import node_adopt, operation_request
from apps.fleet.services.pools import pool_set_queue
from apps.fleet.tasks import reconcile_nodes
from apps.fleet.triton import TritonClient
from apps.registry.codec import parse_pbtxt
from apps.registry.services import version_create
from tests.support.fleet import (
    STEPS_V1,
    STEPS_V2,
    STEPS_V4,
    converged,
    ready_on,
    settled,
    wait_for,
)
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def ask(node: Node) -> str:
    client = TritonClient(node.http_url, node=node.name)
    outputs = client.infer(
        "rag_pipeline", {"QUESTION": np.array([[b"How do I reset my password?"]], dtype=np.object_)}
    )
    return str(outputs["SOURCE"][0][0].decode())


def load_requests(devfleet: Devfleet, node: str, since: int = 0) -> Counter[str]:
    """Load requests the node received, per model, from its own (verbose) log after `since`."""
    text = Path(devfleet.home / f"{node}.log").read_bytes()[since:].decode(errors="replace")
    return Counter(re.findall(r'"HTTP request: \d+ /v2/repository/models/(\S+)/load"', text))


def test_deploy_then_switch_converges_every_node_and_keeps_a_record(pool: NodePool) -> None:
    token = REQUEST_ID.set("ci-deploy-1")  # as the middleware does for a request
    try:
        deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    finally:
        REQUEST_ID.reset(token)
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    # The worker's events for it carry the request's id, through the reconcile and run tasks.
    followed = AuditEvent.objects.filter(request_id="ci-deploy-1")
    assert followed.filter(action="deployment.set").count() == 1
    assert followed.filter(action="node.drift", actor="system:reconciler").exists()
    assert followed.filter(action="operation.load", result="ok").exists()
    for node in pool.nodes.all():
        assert ask(node) == "faq:account-password"
    deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor="system:test")
    wait_for("v2 replaced v1 on every node", converged(pool, STEPS_V2))
    for node in pool.nodes.all():
        assert ask(node) == "faq:account-password"
    ops = Operation.objects.filter(node__pool=pool)
    assert not ops.filter(status__in=["failed", "unknown"]).exists(), list(
        ops.values("kind", "model_name", "error")
    )
    assert (
        ops.filter(kind="load", model_name="rag_pipeline", versions=[2], status="succeeded").count()
        == 3
    )


def test_a_config_triton_refuses_fails_with_its_words_and_the_old_version_serves(
    pool: NodePool, repository: Path
) -> None:
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    # A GPU build of the generator: valid for the registry, refused by a CPU-only node.
    shutil.copytree(repository / "generator" / "2", repository / "generator" / "7")
    text = (repository / "generator" / "config.pbtxt").read_text().replace("KIND_CPU", "KIND_GPU")
    version_create(
        model_name="generator",
        config=parse_pbtxt(text),
        version=7,
        actor="system:test",
        status="published",
    )
    deployment_set(model_name="generator", version=7, pool=pool, actor="system:test")
    failed = Operation.objects.filter(node__pool=pool, model_name="generator", status="failed")
    wait_for(
        "every node refused generator v7", lambda: failed.values("node").distinct().count() == 3
    )
    assert "GPU" in failed.first().error  # Triton's own text
    reconciled_twice(list(pool.nodes.all()))  # counted: the refusal is not retried in a loop
    assert failed.count() == 3
    for node in pool.nodes.all():
        assert ("generator", 1) in ready_on(node) and ask(node) == "faq:account-password"


def test_a_version_missing_from_the_nodes_repository_fails_saying_where_to_look(
    pool: NodePool, repository: Path
) -> None:
    config = (repository / "embedder" / "config.pbtxt").read_text()
    version_create(
        model_name="embedder",
        config=parse_pbtxt(config),
        version=8,  # registered, but no embedder/8/ on the nodes
        actor="system:test",
        status="published",
    )
    node = pool.nodes.first()
    assert node is not None
    deployment_set(model_name="embedder", version=8, node=node, actor="system:test")
    failed = Operation.objects.filter(node=node, model_name="embedder", status="failed")
    wait_for("the load of embedder v8 failed", failed.exists)
    assert "Triton did not find v8: does the node's model repository hold embedder/8/?" in (
        failed.get().error
    )


def test_a_killed_node_turns_unreachable_and_rejoins_without_a_click(
    pool: NodePool, trio: tuple[Devfleet, FleetState]
) -> None:
    devfleet, _ = trio
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    victim, *others = list(pool.nodes.order_by("name"))
    devfleet.kill(victim.name)
    wait_for(
        "the killed node is unreachable",
        lambda: Node.objects.get(pk=victim.pk).health == Node.Health.UNREACHABLE,
    )
    deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor="system:test")
    wait_for("the others converge", lambda: all(ready_on(n) == STEPS_V2 for n in others))
    devfleet.restart(victim.name)  # comes back empty, as a restarted node does
    wait_for("the restarted node converges", lambda: ready_on(victim) == STEPS_V2)
    assert Node.objects.get(pk=victim.pk).health == Node.Health.READY
    assert ask(victim) == "faq:account-password"


def test_a_worker_killed_mid_deployment_loads_nothing_twice(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery
) -> None:
    devfleet, _ = trio
    deployment_set(model_name="rag_pipeline", version=2, pool=pool, actor="system:test")
    # The trio may serve v2 already (the module's nodes outlive each test's database): its
    # nodes are then loaded again, to be sure of their configs, with v2 READY all along. The
    # counts start once every node's v2 load is recorded and nothing of it is still under way.
    pipelines = Operation.objects.filter(
        node__pool=pool, model_name="rag_pipeline", status="succeeded"
    )
    on_v2 = settled(pool, STEPS_V2)
    wait_for(
        "v2 is READY on every node, its loads recorded",
        lambda: pipelines.values("node").distinct().count() == 3 and on_v2(),
    )
    offsets = {
        node.name: (devfleet.home / f"{node.name}.log").stat().st_size for node in pool.nodes.all()
    }
    first_op = Operation.objects.order_by("-id").values_list("id", flat=True).first() or 0
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    running = Operation.objects.filter(node__pool=pool, status="running")
    wait_for("an operation is running", running.exists, timeout=60)
    celery.kill_worker()
    killed_mid = list(running.values_list("node__name", "model_name"))
    celery.start_worker()
    wait_for(
        "every node converges after the new worker starts", converged(pool, STEPS_V1), timeout=240
    )
    for node in pool.nodes.all():
        received = load_requests(devfleet, node.name, since=offsets[node.name])
        ops = Operation.objects.filter(node=node, kind="load", id__gt=first_op).exclude(
            status__in=["queued", "cancelled"]
        )

        # Every distinct load (model and config) reached the node at most once: a redelivered or
        # retried operation would be one request more than there are distinct loads. The killed
        # operation may or may not have reached the node before the worker died.
        def distinct(rows: object) -> Counter[str]:
            return Counter(
                model for model, _ in set(rows.values_list("model_name", "config_digest"))
            )  # type: ignore[attr-defined]

        sent, confirmed = distinct(ops), distinct(ops.filter(status="succeeded"))
        for model in sent:
            assert confirmed[model] <= received[model] <= sent[model], (
                node.name,
                model,
                received,
                sent,
            )
        assert set(received) == set(sent)
    unknown = Operation.objects.filter(node__pool=pool, status="unknown")
    assert set(unknown.values_list("node__name", "model_name")) == set(killed_mid)


def unload_everything(nodes: list[Node]) -> None:
    """Ensembles first, by name, as someone at Triton's API would."""
    for node in nodes:
        client = TritonClient(node.http_url, node=node.name)
        names = {model for model, _ in ready_on(node)}
        for name in sorted(names, key=lambda n: n != "rag_pipeline"):
            client.unload(name)
    wait_for("every node is empty", lambda: all(not ready_on(n) for n in nodes))


def reconciled_twice(nodes: list[Node]) -> None:
    """Two whole reconciles of each node, each one's operations run to their end (here, or by
    a worker that was at the node already)."""
    for _ in range(2):
        for node in nodes:
            reconcile_nodes([node.pk])
        wait_for(
            "no operation is open",
            lambda: not Operation.objects.filter(status__in=["queued", "running"]).exists(),
        )


def test_what_someone_else_loaded_survives_every_reconcile_until_adopted(
    pool: NodePool, trio: tuple[Devfleet, FleetState]
) -> None:
    devfleet, _ = trio
    nodes = list(pool.nodes.order_by("name"))
    unload_everything(nodes)
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    deployment_set(model_name="rag_pipeline", version=4, pool=pool, actor="system:test")
    wait_for("v4 (no reranker) is READY on every node", converged(pool, STEPS_V4))
    # The reranker we loaded, then let go, is loaded again by hand on one node.
    first, second = nodes[0], nodes[1]
    TritonClient(first.http_url, node=first.name).load("reranker")
    hand_loaded = ready_on(first) - STEPS_V4
    assert {model for model, _ in hand_loaded} == {"reranker"}
    since = Operation.objects.order_by("-id").values_list("id", flat=True).first()
    reconciled_twice(nodes)
    assert ready_on(first) == STEPS_V4 | hand_loaded
    # The pool lets go of everything; a person loads the whole v1 pipeline by hand on another
    # node, ensemble included: it is theirs, and nothing of it is unloaded.
    deployment_remove(deployment_id=pool.deployments.get().pk, actor="system:test")
    wait_for("the product unloaded what it loaded", lambda: ready_on(second) == set())
    devfleet.load_release(TritonClient(second.http_url, node=second.name), "rag_pipeline", 1)
    hand_loaded_at = Operation.objects.order_by("-id").values_list("id", flat=True).first()
    reconciled_twice(nodes)
    assert ready_on(second) == STEPS_V1
    assert ready_on(first) == hand_loaded
    assert ask(second) == "faq:account-password"
    unloads = Operation.objects.filter(kind="unload")
    assert not unloads.filter(id__gt=since, node=first, model_name="reranker").exists()
    assert not unloads.filter(id__gt=hand_loaded_at, node=second).exists()
    # Unloading from here needs an adoption first, and the adoption is audited.
    with pytest.raises(FleetError, match="adopt it first"):
        operation_request(node_id=first.pk, kind="unload", model_name="reranker", actor="ops")
    node_adopt(node_id=first.pk, model_name="reranker", actor="ops")
    adopted = AuditEvent.objects.get(action="node.adopt")
    assert (adopted.actor, adopted.target) == ("ops", f"node:{first.name}:reranker")
    wait_for("the adopted reranker is unloaded", lambda: ready_on(first) == set())
    assert ready_on(second) == STEPS_V1
    unload_everything(nodes)


def test_a_pool_on_its_own_queue_is_driven_by_that_queues_worker_alone(
    pool: NodePool, celery: Celery
) -> None:
    nodes = list(pool.nodes.all())
    unload_everything(nodes)
    pool_set_queue(pool_name=pool.name, queue="region-b", actor="ops")
    regional = celery.start_worker_for("region-b")
    logs = {name: celery.root / f"{name}.log" for name in ("worker", "worker-region-b")}
    since = {name: log.stat().st_size for name, log in logs.items()}
    try:
        deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
        wait_for("v1 is READY on every node", converged(pool, STEPS_V1))
    finally:
        os.killpg(regional.pid, signal.SIGTERM)
        regional.wait(30)
    # Only tasks sent since: a retry keeps its id, and one of an earlier test's node work (a
    # node still busy with a load a killed worker sent) goes on where it was sent, the default
    # queue, before the pool had a queue of its own.
    took: dict[str, Counter[str]] = {}
    for name, log in logs.items():
        text = log.read_bytes()
        before, after = text[: since[name]].decode(), text[since[name] :].decode()
        earlier = set(re.findall(r"Task fleet\.\w+\[([\w-]+)\]", before))
        found = re.findall(r"Task (fleet\.\w+)\[([\w-]+)\]", after)
        took[name] = Counter(task for task, task_id in found if task_id not in earlier)
    # Reconciles run their plans (the loads), so no run task is needed on the way.
    node_tasks = {"fleet.poll_node", "fleet.reconcile_nodes", "fleet.run_node"}
    assert {"fleet.poll_node", "fleet.reconcile_nodes"} <= set(took["worker-region-b"]), took
    assert not node_tasks & set(took["worker"]), took  # the default worker fans out, no more
    assert took["worker"]["fleet.reconcile_all"] >= 1
    unload_everything(nodes)
