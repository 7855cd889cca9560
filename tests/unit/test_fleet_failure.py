"""How the fleet's workers fail safely, and what a reconcile costs: the observed state read from a
bounded part of a node's operation history; a worker whose lease lapsed is neither joined by the
next owner mid-load nor allowed to overwrite how the next owner recorded its operation; a node
whose name HAProxy could not take is refused (tests/integration/test_connections.py speaks to
real servers)."""

import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.fleet import reconcile, runner
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.planner import Observed
from apps.fleet.reconcile import node_reconcile, nodes_reconcile, observed_state
from apps.fleet.runner import DesiredDigest, NodeBusy, node_run
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.fleet.tasks import reconcile_nodes
from apps.fleet.triton import IndexEntry, TritonClient
from tests.support.registry import import_demo

pytestmark = pytest.mark.django_db
DONE = [Operation.Status.SUCCEEDED, Operation.Status.FAILED, Operation.Status.UNKNOWN]


def a_node(name: str = "n1") -> Node:
    pool, _ = NodePool.objects.get_or_create(name="p")
    return Node.objects.create(name=name, pool=pool, http_url="http://127.0.0.1:1")


def whole_history(node: Node) -> dict[str, Observed]:
    """observed_state as it was: every finished operation of the node, read in order."""
    ready: dict[str, set[int]] = {}
    busy: set[str] = set()
    for entry in node.index:
        ready.setdefault(entry["model"], set())
        if entry.get("state") == "READY" and entry.get("version") is not None:
            ready[entry["model"]].add(int(entry["version"]))
        elif entry.get("state") in ("LOADING", "UNLOADING"):
            busy.add(entry["model"])
    last_ok: dict[str, str] = {}
    failed: dict[str, set[str]] = {}
    now = timezone.now()
    for op in node.operations.filter(status__in=DONE).order_by("finished_at", "id"):
        if op.status == Operation.Status.UNKNOWN:
            if ready.get(op.model_name, set()) == set(op.versions):
                last_ok[op.model_name] = op.config_digest
        elif op.status == Operation.Status.SUCCEEDED:
            last_ok[op.model_name] = op.config_digest
            failed.pop(op.model_name, None)
        elif op.retry_at is None or op.retry_at > now:
            failed.setdefault(op.model_name, set()).add(op.config_digest)
        else:
            failed.get(op.model_name, set()).discard(op.config_digest)
    return {
        name: Observed(
            ready=frozenset(versions),
            busy=name in busy,
            digest=last_ok.get(name, ""),
            failed=frozenset(failed.get(name, ())),
        )
        for name, versions in ready.items()
    } | {
        name: Observed(frozenset(), digest="", failed=frozenset(digests))
        for name, digests in failed.items()
        if name not in ready
    }


def random_history(node: Node, rng: random.Random, size: int) -> None:
    """Operations of a few models, any status, some finished at the same instant (or, written
    by hand, at none), failures due again or not, versions asked in either order."""
    now = timezone.now()
    statuses = [*DONE, Operation.Status.CANCELLED, Operation.Status.QUEUED]
    Operation.objects.bulk_create(
        Operation(
            node=node,
            kind="unload" if rng.random() < 0.1 else "load",
            model_name=rng.choice(["embedder", "retriever", "generator", "gone"]),
            versions=rng.choice([[1], [2], [1, 2], [2, 1], []]),
            config_digest=rng.choice(["d1", "d2", "d3"]),
            requested_by="system:reconciler",
            status=rng.choice(statuses),
            retry_at=rng.choice([None, now - timedelta(seconds=5), now + timedelta(seconds=60)]),
            finished_at=None if rng.random() < 0.05 else now - timedelta(seconds=rng.randint(0, 9)),
        )
        for _ in range(size)
    )
    node.index = [
        {"model": model, "version": version, "state": state, "reason": ""}
        for model, version, state in rng.sample(
            [
                ("embedder", 1, "READY"),
                ("embedder", 2, "READY"),
                ("retriever", 2, "READY"),
                ("generator", 1, "LOADING"),
                ("unmanaged", 1, "READY"),
            ],
            k=rng.randint(0, 5),
        )
    ]


@pytest.mark.parametrize("seed", range(12))
def test_the_observed_state_is_what_the_whole_history_read_in_order_says(seed: int) -> None:
    node = a_node()
    random_history(node, random.Random(seed), size=60)
    assert observed_state(node) == whole_history(node)


def a_long_history(node: Node, size: int) -> None:
    """`size` finished operations over two models: every kind of ending, whatever the size."""
    start = timezone.now() - timedelta(days=30)
    endings = [Operation.Status.SUCCEEDED, Operation.Status.FAILED, Operation.Status.UNKNOWN]
    Operation.objects.bulk_create(
        (
            Operation(
                node=node,
                kind="load",
                model_name=("embedder", "retriever")[i % 2],
                versions=[1],
                config_digest="d1",
                requested_by="system:reconciler",
                status=endings[(i // 2) % 3],
                finished_at=start + timedelta(seconds=i),
            )
            for i in range(size)
        ),
        batch_size=2000,
    )


@contextmanager
def rows_fetched() -> Iterator[list[int]]:
    """The rows each query returns, counted by the database itself (each SELECT again, as a
    count): a query that reads a whole history shows however short its Python loop is."""
    counts: list[int] = []

    def count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("SELECT"):
            inner = sql.split(" FOR UPDATE")[0]  # the lock clause ends the statement
            cursor = context["connection"].create_cursor()
            try:
                counted = f"SELECT COUNT(*) FROM ({inner}) AS fetched"  # noqa: S608 - Django's own SQL
                cursor.execute(counted, params)
                counts.append(cursor.fetchone()[0])
            finally:
                cursor.close()
        return result

    with connection.execute_wrapper(count):
        yield counts


def test_a_nodes_reconcile_costs_the_same_with_10_and_10000_finished_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = [IndexEntry("embedder", 1, "READY", ""), IndexEntry("retriever", 1, "READY", "")]
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: index)
    costs = []
    for name, size in (("short", 10), ("long", 10_000)):
        node = a_node(name)
        a_long_history(node, size)
        assert node.operations.count() == size
        node_reconcile(node_id=node.pk)  # the pool's desired state is computed once, here
        with CaptureQueriesContext(connection) as queries, rows_fetched() as rows:
            assert node_reconcile(node_id=node.pk) == []
        costs.append((len(queries), rows))
    (short_queries, short_rows), (long_queries, long_rows) = costs
    assert short_queries == long_queries
    assert short_rows == long_rows
    assert max(long_rows) < 10


def loading_to_index(monkeypatch: pytest.MonkeyPatch, then: Callable[[str], None]) -> list[str]:
    """Triton at the client's boundary: each model loaded shows READY at v1 in the index, and
    `then` runs as its load is sent. Returns the models loaded, in order."""
    loaded: list[str] = []

    def load(self: TritonClient, model: str, **_: Any) -> None:
        loaded.append(model)
        then(model)

    monkeypatch.setattr(TritonClient, "load", load)
    monkeypatch.setattr(
        TritonClient,
        "repository_index",
        lambda self: [IndexEntry(m, 1, "READY", "") for m in loaded],
    )
    return loaded


def test_a_planned_run_reads_neither_the_pool_nor_its_plan_nor_a_serving_nodes_stage_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's reconcile hands its run what it read under the node's lock and what it
    planned: the run reads neither the node's pool nor the operations just written again, and
    a node that was serving is not asked whether it joined. The run is two statements: the
    lease taken with the first claim, and the end (its event with it) that gives the lease
    back if nothing was queued meanwhile. Issue 30: each statement here is paid by every node
    of a release."""
    import_demo()
    node = a_node()
    Node.objects.filter(pk=node.pk).update(stage=Node.Stage.SERVING)
    loading_to_index(monkeypatch, lambda model: None)
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    with CaptureQueriesContext(connection) as queries:
        reconcile_nodes([node.pk])
    assert list(Operation.objects.values_list("model_name", "status")) == [
        ("embedder", Operation.Status.SUCCEEDED)
    ]
    sql = [query["sql"] for query in queries]
    assert [q for q in sql if 'FROM "fleet_nodepool"' in q] == []
    assert [q for q in sql if '"fleet_node"."stage" = ' in q] == []
    if connection.vendor == "postgresql":  # SQLite takes the lease, then claims: a statement more
        taken = next(n for n, q in enumerate(sql) if q.startswith("WITH taken AS"))
        assert "UPDATE fleet_operation SET status" in sql[taken]  # the claim
        assert len(sql[taken:]) == 2 and "SET lease_owner = ''" in sql[-1], sql[taken:]
    assert Node.objects.values_list("lease_owner", "lease_until").get() == ("", None)
    # A plan for a new desired state looks for no earlier drift to repeat, finds its request
    # with the node's lock, and its run has no lost operation to look for.
    assert [q for q in sql if 'FROM "audit_auditevent"' in q] == []
    assert [q for q in sql if q.startswith('SELECT "fleet_deployment"."request_id"')] == []
    assert [q for q in sql if "lost mid-operation" in q] == []


def test_a_chunk_of_nodes_is_planned_in_as_many_statements_as_one_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read, desired state, lock, history, owned models, operations and drift events: one
    statement each for a chunk of nodes, whatever its size. Issue 30: a release to 5,000 nodes
    plans them 20 at a time."""
    import_demo()
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # empty nodes
    first = a_node("a0")
    deployment_set(model_name="embedder", version=1, pool=first.pool, actor="system:test")
    nodes_reconcile([first.pk])  # the pool's desired state computed, as each worker does once

    def planned(names: list[str]) -> int:
        nodes = [a_node(name) for name in names]
        with CaptureQueriesContext(connection) as queries:
            plans = nodes_reconcile([node.pk for node in nodes])
        assert sorted(plans) == [node.pk for node in nodes]
        assert all(len(plan.ops) == 1 for plan in plans.values())
        return len(queries)

    assert planned(["a1"]) == planned([f"b{n}" for n in range(6)])
    assert AuditEvent.objects.filter(action="node.drift").count() == 8


def test_the_runs_of_a_chunk_look_again_at_their_desired_state_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk's nodes run one after another: those whose run starts a second or more after
    the plan look at their desired state and memory fields again, in two statements for all
    of them, once a second at most."""
    import_demo()
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # empty nodes
    nodes = [a_node(f"n{n}") for n in range(3)]
    deployment_set(model_name="embedder", version=1, pool=nodes[0].pool, actor="system:test")
    plans = nodes_reconcile([node.pk for node in nodes])
    planned = {plan.wanted.digest() for plan in plans.values()}
    Node.objects.filter(pk=nodes[2].pk).update(memory_limit_mb=8000)
    clock = time.monotonic()
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock)

    def looked() -> set[str | None]:
        nonlocal clock
        clock += DesiredDigest.RECHECK_S
        return {plan.wanted.digest() for plan in plans.values()}

    with CaptureQueriesContext(connection) as queries:
        assert looked() == planned
    assert len(queries) == 2
    assert plans[nodes[2].pk].wanted.node.memory_limit_mb == 8000
    deployment_set(model_name="embedder", version=2, pool=nodes[0].pool, actor="system:test")
    changed = looked()
    assert len(changed) == 1 and changed != planned


@pytest.mark.django_db(transaction=True)
def test_a_plan_committed_while_a_reconcile_waits_for_the_nodes_lock_is_pending_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two reconciles of one node at once (a change's and the periodic one): the second waits
    for the first's lock, then must see the plan the first committed meanwhile, not plan every
    load again beside it."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks and READ COMMITTED snapshots are PostgreSQL's")
    import_demo()
    node = a_node()
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # an empty node
    holding = threading.Event()

    def first_reconcile() -> None:
        """Plans under the node's lock, and commits once the second waits for that lock."""
        try:
            with transaction.atomic():
                Node.objects.select_for_update().get(pk=node.pk)
                Operation.objects.create(
                    node_id=node.pk, kind="load", model_name="embedder", versions=[1]
                )
                holding.set()
                waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                deadline = time.monotonic() + 10
                with connection.cursor() as cursor:
                    while time.monotonic() < deadline:
                        cursor.execute(waiting)
                        if cursor.fetchone()[0]:
                            break
                        time.sleep(0.01)
        finally:
            connection.close()

    first = threading.Thread(target=first_reconcile)
    desired = reconcile.nodes_desired

    def meanwhile(nodes: list[Node]) -> dict:
        """The first reconcile takes the lock as the second has read the node, before it locks."""
        first.start()
        holding.wait(10)
        return desired(nodes)

    monkeypatch.setattr(reconcile, "nodes_desired", meanwhile)
    planned = nodes_reconcile([node.pk])
    first.join()
    assert planned == {}
    assert Operation.objects.count() == 1


def test_an_operation_queued_while_a_run_goes_on_is_run_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The end of the plan's last step gives the lease back only if nothing is queued: what a
    person queued meanwhile is read and run by the same run (an empty queue is only looked
    at, with that end: the test above)."""
    import_demo()
    node = a_node()
    Node.objects.filter(pk=node.pk).update(stage=Node.Stage.SERVING)

    def queue_one(model: str) -> None:
        if model == "embedder":
            Operation.objects.create(
                node=node, kind="load", model_name="reranker", versions=[1], requested_by="alice"
            )

    loaded = loading_to_index(monkeypatch, queue_one)
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    reconcile_nodes([node.pk])
    assert loaded == ["embedder", "reranker"]
    assert list(Operation.objects.order_by("id").values_list("requested_by", "status")) == [
        ("system:reconciler", Operation.Status.SUCCEEDED),
        ("alice", Operation.Status.SUCCEEDED),
    ]


def test_each_step_of_a_plan_is_claimed_with_the_end_of_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's end, its event and the next step's claim are one statement on PostgreSQL; the
    first step is claimed with the node's lease (issue 30: a release pays each for every load
    of every node)."""
    import_demo()
    node = a_node()
    Node.objects.filter(pk=node.pk).update(stage=Node.Stage.SERVING)
    loaded = loading_to_index(monkeypatch, lambda model: None)
    deployment_set(model_name="rag_pipeline", version=1, pool=node.pool, actor="system:test")
    with CaptureQueriesContext(connection) as queries:
        reconcile_nodes([node.pk])
    assert loaded == ["embedder", "generator", "reranker", "retriever", "rag_pipeline"]
    ops = Operation.objects.order_by("seq")
    assert [(op.status, op.attempts) for op in ops] == [("succeeded", 1)] * 5
    assert AuditEvent.objects.filter(action="operation.load", result="ok").count() == 5
    claims = [q["sql"] for q in queries if re.search(r"""SET "?status"? = 'running'""", q["sql"])]
    if connection.vendor == "postgresql":
        assert len(claims) == 1 + 4 and claims[0].startswith("WITH taken")
        assert sum(q.startswith("WITH changed") for q in claims) == 4


def test_a_step_no_longer_queued_when_the_one_before_ends_is_neither_claimed_nor_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import_demo()
    node = a_node()
    Node.objects.filter(pk=node.pk).update(stage=Node.Stage.SERVING)

    def cancel_the_next(model: str) -> None:
        if model == "embedder":  # as another hand would, while embedder loads
            Operation.objects.filter(model_name="generator").update(status="cancelled")

    loaded = loading_to_index(monkeypatch, cancel_the_next)
    deployment_set(model_name="rag_pipeline", version=1, pool=node.pool, actor="system:test")
    reconcile_nodes([node.pk])
    assert loaded == ["embedder"]
    ops = Operation.objects.order_by("seq")
    assert [(op.model_name, op.status) for op in ops][:2] == [
        ("embedder", "succeeded"),
        ("generator", "cancelled"),
    ]
    assert {op.status for op in ops[2:]} == {"cancelled"}
    assert "not run: step 1 (load generator) cancelled" in ops[2].error


def test_a_lapsed_lease_is_not_taken_while_its_load_may_still_be_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker cut off from the database keeps waiting on the load it sent; the next one must
    not send a second load beside it, nor declare it lost, until that load's time is up."""
    node = a_node()
    sent: list[str] = []
    monkeypatch.setattr(TritonClient, "load", lambda self, model, **_: sent.append(model))
    monkeypatch.setattr(
        TritonClient, "repository_index", lambda self: [IndexEntry("retriever", 1, "READY", "")]
    )
    lapsed = timezone.now() - timedelta(seconds=1)
    Node.objects.filter(pk=node.pk).update(lease_owner="cut-off", lease_until=lapsed)
    sending = Operation.objects.create(
        node=node,
        kind="load",
        model_name="embedder",
        versions=[1],
        requested_by="ops",
        status=Operation.Status.RUNNING,
        started_at=timezone.now() - timedelta(seconds=10),
    )
    next_one = Operation.objects.create(
        node=node, kind="load", model_name="retriever", versions=[1], requested_by="ops"
    )
    with pytest.raises(NodeBusy):
        node_run(node_id=node.pk)
    sending.refresh_from_db()
    next_one.refresh_from_db()
    assert sending.status == Operation.Status.RUNNING and not sending.error
    assert next_one.status == Operation.Status.QUEUED and sent == []

    # Past the load's timeout no answer can come any more: it is lost, and the next one runs.
    timed_out = timedelta(seconds=settings.FLEET_LOAD_TIMEOUT_S + settings.TRITON_TIMEOUT_S + 1)
    Operation.objects.filter(pk=sending.pk).update(started_at=timezone.now() - timed_out)
    node_run(node_id=node.pk)
    sending.refresh_from_db()
    next_one.refresh_from_db()
    assert sending.status == Operation.Status.UNKNOWN and "worker was lost" in sending.error
    assert next_one.status == Operation.Status.SUCCEEDED and sent == ["retriever"]


def test_an_operation_declared_lost_meanwhile_keeps_the_new_owners_record_and_no_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = a_node()
    declared = "the worker was lost mid-operation; the reconciler reads the node's state"

    def load_while_taken_over(self: TritonClient, model: str, **_: object) -> None:
        # The load takes long; meanwhile the next owner of the node declares it lost.
        Operation.objects.filter(status=Operation.Status.RUNNING).update(
            status=Operation.Status.UNKNOWN, finished_at=timezone.now(), error=declared
        )

    monkeypatch.setattr(TritonClient, "load", load_while_taken_over)
    monkeypatch.setattr(
        TritonClient, "repository_index", lambda self: [IndexEntry("embedder", 1, "READY", "")]
    )
    first, second = (
        Operation.objects.create(
            node=node, kind="load", model_name=name, versions=[1], requested_by="ops"
        )
        for name in ("embedder", "retriever")
    )
    node_run(node_id=node.pk)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, first.error) == (Operation.Status.UNKNOWN, declared)
    assert not AuditEvent.objects.filter(action__startswith="operation.").exists()
    assert Node.objects.get(pk=node.pk).owned == []
    assert second.status == Operation.Status.QUEUED  # the node is the next owner's now


@pytest.mark.parametrize("name", ["n1;shutdown", "n1 n2", "n1\n", "n1/x", "n\u00e9"])
def test_a_node_name_haproxy_could_not_take_is_refused_at_registration(name: str) -> None:
    with pytest.raises(FleetError, match="only letters, digits"):
        node_register(
            name=name,
            pool="p",
            http_url="http://127.0.0.1:8100",
            grpc_url="",
            metrics_url="",
            actor="system:test",
        )
    assert not Node.objects.exists()
    assert "only letters, digits" in AuditEvent.objects.get(action="node.register").message
