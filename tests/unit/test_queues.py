"""Rollout and degradation ticks and beat's heartbeat go to a queue of their own, so that a
release's thousands of node tasks on the default queue never delay a rollback decision."""

from collections import Counter

import pytest
from django.conf import settings
from django.db import OperationalError

from apps.fleet import tasks
from apps.fleet.models import Node, NodePool
from apps.fleet.queues import ROLLOUTS_QUEUE
from apps.fleet.reconcile import Planned
from apps.fleet.runner import DesiredDigest
from controlplane.celery import app as celery_app


def queue_of(task: str) -> str:
    return celery_app.amqp.router.route({}, task)["queue"].name


def test_the_rollout_controller_the_degradation_automation_and_the_heartbeat_go_apart() -> None:
    assert ROLLOUTS_QUEUE == "rollouts"
    for task in (
        "rollouts.advance_all",
        "rollouts.advance",
        "degradation.tick_all",
        "degradation.tick",
        "fleet.heartbeat",
    ):
        assert queue_of(task) == "rollouts", task


@pytest.mark.django_db
def test_each_pools_tiers_are_judged_in_a_task_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from apps.degradation import tasks as degradation
    from apps.degradation.models import Tiers
    from apps.registry.models import Model

    model = Model.objects.create(name="rag_pipeline")
    for name in ("a", "b"):
        Tiers.objects.create(pool=NodePool.objects.create(name=name), model=model, versions=[1, 4])
    sent: list[int] = []
    monkeypatch.setattr(degradation.degradation_tick, "delay", sent.append)
    degradation.degradation_tick_all()
    assert sorted(sent) == sorted(Tiers.objects.values_list("id", flat=True))


def test_beats_schedule_sends_ticks_and_heartbeats_there_and_node_work_elsewhere() -> None:
    queues = {
        name: queue_of(entry["task"]) for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
    }
    assert queues["rollouts"] == queues["heartbeat"] == queues["degradation"] == "rollouts"
    default = celery_app.conf.task_default_queue
    assert queues["poll-nodes"] == queues["reconcile"] == default != "rollouts"
    # A node's own work, and webhooks, stay on the default queue (or its pool's).
    for task in ("fleet.reconcile_nodes", "fleet.poll_node", "rollouts.deliver_notification"):
        assert queue_of(task) == default, task


@pytest.mark.django_db
def test_a_change_outlives_the_queue_ahead_of_it_and_a_periodic_pass_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release queues a reconcile per node at once: at 5,000 nodes the last waits minutes, past
    the periodic pass's expiry, which would drop it unseen."""
    east = Node.objects.create(
        name="gpu-1", pool=NodePool.objects.create(name="gpu", queue="east"), http_url="http://x:1"
    )
    sent: list[dict] = []
    monkeypatch.setattr(
        tasks.reconcile_nodes, "apply_async", lambda args, **options: sent.append(options)
    )
    tasks.reconcile_change([east.pk])
    tasks.reconcile_all()
    assert sent == [{"queue": "east", "expires": tasks.CHANGE_EXPIRES_S}, {"queue": "east"}]
    assert tasks.reconcile_nodes.expires < tasks.CHANGE_EXPIRES_S


@pytest.mark.django_db
def test_a_large_queues_nodes_go_in_chunks_and_a_small_ones_each_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of CHUNK_NODES at most, and SPREAD tasks at least where a queue has that many
    nodes: a pool's change of 100 nodes keeps 8 workers busy, in chunks of 12."""
    big, mid, small = (
        NodePool.objects.create(name="big", queue="east"),
        NodePool.objects.create(name="mid", queue="west"),
        NodePool.objects.create(name="small"),
    )
    Node.objects.bulk_create(
        [Node(name=f"b{n}", pool=big, http_url="http://x:1") for n in range(700)]
        + [Node(name=f"m{n}", pool=mid, http_url="http://x:1") for n in range(100)]
        + [Node(name=f"s{n}", pool=small, http_url="http://x:1") for n in range(3)]
        + [Node(name="gone", pool=small, http_url="http://x:1", stage=Node.Stage.DEPARTED)]
    )
    sent: list[tuple[list[int], str | None]] = []
    monkeypatch.setattr(
        tasks.reconcile_nodes,
        "apply_async",
        lambda args, queue=None, **options: sent.append((args[0], queue)),
    )
    tasks.reconcile_all()
    chunks = Counter((len(ids), queue) for ids, queue in sent)
    assert chunks == {
        (tasks.CHUNK_NODES, "east"): 35,
        (12, "west"): 8,
        (4, "west"): 1,
        (1, None): 3,
    }
    ids = [node_id for chunk, _ in sent for node_id in chunk]
    departed = Node.objects.get(name="gone").pk
    assert sorted(ids) == sorted(Node.objects.exclude(pk=departed).values_list("pk", flat=True))


@pytest.mark.django_db
def test_a_chunk_past_its_budget_hands_the_rest_of_its_runs_to_a_task_a_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk's nodes are planned together, and each chunk runs one node at least; the runs
    left when its budget is spent go to their queue as run_node tasks (slow nodes are where a
    task a node costs least), and a node whose run raised does not stop the others."""
    pool = NodePool.objects.create(name="big", queue="east")
    ids = [Node.objects.create(name=f"n{n}", pool=pool, http_url="http://x:1").pk for n in range(3)]
    ran: list[int] = []

    def run(*, node_id: int, wanted: DesiredDigest) -> None:
        ran.append(node_id)
        raise RuntimeError("the database went away")

    def planned(node_ids: list[int]) -> dict[int, Planned]:
        return {node_id: Planned([], DesiredDigest(), "") for node_id in node_ids}

    sent: list[tuple[int, dict]] = []
    monkeypatch.setattr(tasks, "nodes_reconcile", planned)
    monkeypatch.setattr(tasks, "node_run", run)
    monkeypatch.setattr(tasks, "CHUNK_BUDGET_S", -1)
    monkeypatch.setattr(
        tasks.run_node, "apply_async", lambda args, **options: sent.append((args[0], options))
    )
    tasks.reconcile_nodes(ids)
    assert ran == ids[:1]
    assert sent == [(ids[1], {"queue": "east"}), (ids[2], {"queue": "east"})]
    monkeypatch.setattr(tasks, "CHUNK_BUDGET_S", 60)
    tasks.reconcile_nodes(ids)
    assert ran == [ids[0], *ids]


@pytest.mark.django_db
def test_a_chunk_whose_plan_the_database_refused_is_tried_again_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deadlock, say, while its nodes are locked: acked and dropped, the chunk would wait for
    the next periodic pass (and a benchmark without beat, for ever)."""
    pool = NodePool.objects.create(name="big", queue="east")
    ids = [Node.objects.create(name=f"n{n}", pool=pool, http_url="http://x:1").pk for n in range(2)]
    tries: list[list[int]] = []

    def planned(node_ids: list[int]) -> dict[int, Planned]:
        tries.append(node_ids)
        if len(tries) == 1:
            raise OperationalError("deadlock detected")
        return {}

    monkeypatch.setattr(tasks, "nodes_reconcile", planned)
    result = tasks.reconcile_nodes.apply((ids,))  # eager: the retry runs at once, in-process
    assert result.successful() and tries == [ids, ids]
