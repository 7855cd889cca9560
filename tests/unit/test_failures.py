"""Failed loads told apart, and only transient ones tried again, later and later: the words
Triton uses (as its logs and load errors have them), the schedule, and the reconciler's view,
Triton stubbed at its client."""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet import failures
from apps.fleet.models import Node, Operation
from apps.fleet.reconcile import observed_state
from apps.fleet.runner import node_run
from apps.fleet.triton import TritonClient, TritonRejected


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            "failed to load 'gen' v2: Internal: CUDA out of memory. Tried to allocate",
            "out_of_memory",
        ),
        (
            "load failed for model 'gen': v1 is at UNAVAILABLE state: std::bad_alloc",
            "out_of_memory",
        ),
        ("Triton did not find v3: does the node's model repository hold gen/3/?", "missing"),
        ("failed to stat file /models/gen/2/model.onnx", "missing"),
        ("load failed for model 'gen': Invalid argument: unexpected platform type 'foo'", "config"),
        ("Internal: ModuleNotFoundError: No module named 'torch'", "missing"),
        ("Internal: Stub process 'gen_0_0' is not healthy.", "backend"),
        ("failed to load 'gen': Deadline Exceeded", "timeout"),
    ],
)
def test_a_failure_is_told_apart_by_tritons_words(error: str, kind: str) -> None:
    assert failures.classify(error) == kind


def test_only_transient_failures_are_tried_again_later_and_later() -> None:
    now = timezone.now()
    assert failures.retry_at("config", 1, now) is None
    assert failures.retry_at("missing", 1, now) is None
    assert failures.retry_at("memory", 1, now) is None
    waits = [failures.retry_at("out_of_memory", tries, now) for tries in (1, 2, 3, 4)]
    assert waits == [now + timedelta(seconds=s) for s in (15, 30, 60)] + [None]
    late = failures.retry_at("backend", 1, now - timedelta(seconds=30))
    assert failures.retry_at("backend", 1, now) > now and late is not None and late <= now


def test_a_transient_failure_is_planned_again_once_due_and_a_permanent_one_is_not(
    node: Node,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = {"embedder": "Internal: CUDA out of memory", "retriever": "Invalid argument: bad dims"}

    def refuse(self: TritonClient, model: str, *, config_json: str | None = None) -> None:
        raise TritonRejected(self.node, said[model])

    monkeypatch.setattr(TritonClient, "load", refuse)
    for name in said:
        Operation.objects.create(
            node=node, kind="load", model_name=name, versions=[1], requested_by="ops"
        )
    node_run(node_id=node.pk)
    oom = Operation.objects.get(model_name="embedder")
    bad = Operation.objects.get(model_name="retriever")
    assert (oom.failure, bad.failure) == ("out_of_memory", "config")
    assert oom.retry_at is not None and bad.retry_at is None
    assert "(tried again at" in oom.error and "tried again" not in bad.error

    def held(op: Operation) -> bool:
        """Whether the reconciler holds the load back, as failed."""
        seen = observed_state(node).get(op.model_name)
        return seen is not None and op.config_digest in seen.failed

    assert held(oom) and held(bad)  # the transient one is not due yet
    Operation.objects.filter(pk=oom.pk).update(retry_at=timezone.now())
    assert not held(oom) and held(bad)

    # Failing again, it waits twice as long; the fourth try is the last.
    again = Operation.objects.create(
        node=node, kind="load", model_name="embedder", versions=[1], requested_by="ops"
    )
    node_run(node_id=node.pk)
    again.refresh_from_db()
    assert again.retry_at is not None and again.finished_at is not None
    assert round((again.retry_at - again.finished_at).total_seconds()) == 30
