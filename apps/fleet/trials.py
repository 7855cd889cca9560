"""A node held aside for trials of one model's config: out of traffic, leased so that no
reconcile loads on it meanwhile, each trial config a load in the node's operations (sent, then
read back READY), and the config it served before loaded again at the end.

A worker lost mid-trial leaves a trial's load as the node's last of that model: its config
digest is not the desired one, so the reconciler, which reads the node's history, loads the
desired config again once the lease lapses; the node is back in traffic then only after it."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.utils import timezone

from apps.audit.services import audit_record
from apps.fleet.desired import digest
from apps.fleet.lease import Lease
from apps.fleet.models import Node, Operation
from apps.fleet.runner import read_back
from apps.fleet.traffic.balancer import PoolAtCapacity, balancer, drained
from apps.fleet.triton import TritonClient, TritonError
from apps.registry.codec import tuned


class TrialError(Exception):
    """The node cannot be held aside for trials; says which node and why."""


class Aside:
    """The node held aside: `load` one trial config after the other."""

    def __init__(self, node: Node, base: Operation, actor: str) -> None:
        self.node, self.base, self.actor = node, base, actor

    def load(self, fields: dict[str, Any]) -> str:
        """The model loaded with `fields` laid over the config it served; "" once read back
        READY at its versions, else what Triton said or showed."""
        return _load(self.node, self.base, tuned(self.base.config or {}, fields), self.actor)


@contextmanager
def held_aside(node: Node, model: str, actor: str) -> Iterator[Aside]:
    """`node` out of traffic and leased while the block runs, `model` loaded back as it was at
    the end. Raises TrialError, before anything changes, for a pool that cannot take the node
    out of traffic, a node busy with its operations, a model the node never loaded."""
    if balancer(node.pool) is None:
        raise TrialError(
            f"pool {node.pool.name} has no balancer: {node.name} cannot be taken out of traffic, "
            "and its users would meet every trial"
        )
    base = (
        Operation.objects.filter(
            node=node, model_name=model, kind=Operation.Kind.LOAD, status=Operation.Status.SUCCEEDED
        )
        .order_by("-id")
        .first()
    )
    if base is None or base.config is None:
        raise TrialError(f"{node.name} has not loaded {model}: there is no config to try against")
    with Lease(node.pk).hold() as lease:
        if not lease.held:
            raise TrialError(f"{node.name} is busy with its operations; try again once they end")
        try:
            with drained(node):
                try:
                    yield Aside(node, base, actor)
                finally:
                    if error := _load(node, base, base.config, actor):
                        raise TrialError(
                            f"{node.name}: {model} could not be loaded back as it was ({error}); "
                            "the reconciler loads its desired config again"
                        )
        except PoolAtCapacity as exc:
            raise TrialError(f"{node.name} cannot leave traffic: {exc}") from None


def _load(node: Node, base: Operation, config: dict[str, Any], actor: str) -> str:
    op = Operation.objects.create(
        node=node,
        kind=Operation.Kind.LOAD,
        model_name=base.model_name,
        versions=base.versions,
        config=config,
        config_digest=digest(config),
        requested_by=actor,
        status=Operation.Status.RUNNING,
        attempts=1,
        started_at=timezone.now(),
    )
    client = TritonClient.of(node)
    try:
        client.load(base.model_name, config_json=json.dumps(config))
        error = read_back(client, op)
    except TritonError as exc:
        error = str(exc)
    status = Operation.Status.FAILED if error else Operation.Status.SUCCEEDED
    Operation.objects.filter(pk=op.pk).update(
        status=status, error=error, finished_at=timezone.now()
    )
    audit_record(
        actor=actor,
        action="operation.load",
        target=f"node:{node.name}:{base.model_name}",
        after={"versions": base.versions, "digest": op.config_digest},
        result="failed" if error else "ok",
        message=error,
    )
    return error
