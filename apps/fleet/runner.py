"""Converging a node, the second half: run its queued operations one at a time, under a lease
on the node, each confirmed by reading the node's repository index back; loads out of traffic
where the pool has a balancer. The reconcile (apps/fleet/reconcile.py) plans them."""

import json
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

from django.db import connection, transaction
from django.utils import timezone

from apps.audit.services import Statement, audit_event, audit_update
from apps.fleet import failures, memory, quarantine
from apps.fleet.desired import DesiredStateError, node_desired, nodes_desired
from apps.fleet.lease import Lease
from apps.fleet.models import Node, Operation
from apps.fleet.traffic.balancer import balancer, drained
from apps.fleet.traffic.warmup import warm_up
from apps.fleet.triton import (
    TritonClient,
    TritonDropped,
    TritonError,
    TritonRejected,
    TritonTimeout,
    TritonUnreachable,
    ready_in,
)
from apps.registry.codec import stored_steps
from apps.web.prepared import prepared_cursor

log = logging.getLogger(__name__)
RECONCILER = "system:reconciler"  # the actor of what the reconcile plans


class NodeBusy(Exception):
    """Another worker holds the node, or may still be at it; try again shortly."""


def node_run(*, node_id: int, wanted: "DesiredDigest | None" = None) -> None:
    """Run the node's queued operations in order, holding its lease; a plan's steps stop when
    the desired state they were planned for is no longer the node's (`wanted`, if the caller
    just planned them, knows what that was)."""
    drains, claim = None, None
    if wanted is not None and wanted.planned:
        assert wanted.node is not None  # seeded with what was planned
        drains = _drains(wanted.node, wanted.planned)
        # Nothing comes between the lease and the first operation: claimed with it.
        if not drains and not _superseded(wanted.planned[0], wanted):
            claim = _claim(wanted.planned[0])
    with Lease(node_id).hold(claim) as lease:
        if not lease.held:
            if not Node.objects.filter(pk=node_id).exists():
                return  # removed since the run was asked for: its operations went with it
            raise NodeBusy(node_id)
        # We hold the lease, so an operation still marked running lost its worker mid-way. Not
        # after a plan made just now: its reconcile found no open operation, and one claimed
        # since by a worker lost meanwhile would still keep the lease from us (lease._TAKE).
        if wanted is None or not wanted.planned:
            Operation.objects.filter(node_id=node_id, status=Operation.Status.RUNNING).update(
                status=Operation.Status.UNKNOWN,
                finished_at=timezone.now(),
                error="the worker was lost mid-operation; the reconciler reads the node's state",
            )
        if wanted is None or wanted.node is None:
            wanted = DesiredDigest()
            wanted.node = Node.objects.select_related("pool").get(pk=node_id)
        node = wanted.node
        # The operations just planned are the first batch as they were written, configs and
        # all: reading them back would cost a statement and decoding every config again.
        if not (first := wanted.planned or _next_batch(node)):
            return
        if not (_drains(node, first) if drains is None else drains):
            # The run ends with its last operation: the lease goes with that one's end.
            _run_queued(node, first, wanted, lease, last=True)
            return
        with drained(node) as out_of_traffic:
            loaded = _run_queued(node, first, wanted, lease)
            if out_of_traffic:
                warm_up(node, loaded)


def _drains(node: Node, queued: list[Operation]) -> bool:
    """Whether the run takes the node out of traffic: loads of weights, on a pool with a traffic
    strategy; they never meet live requests, and what they loaded is warmed before the node
    takes them again. A pool without one never takes its nodes out of traffic: its live
    requests meet the loads as they land, and there is no "before" to warm them in. Nor does
    a move back (a rollback inside the window, an abort, a fallback to a warm version) or a
    pipeline switching to steps already loaded (a blue-green switch): every node at once, in
    traffic, with nothing to warm up."""
    return balancer(node.pool) is not None and not _loads_nothing(node, queued)


def _next_batch(node: Node) -> list[Operation]:
    """The node's queued operations, in order (each op.node is `node`); read only when there
    are any: after the run of each node of a release there are none, and a prepared look
    costs a fraction of the read."""
    with prepared_cursor() as cursor:
        cursor.execute(_ANY_QUEUED, (node.pk,))
        if not cursor.fetchone()[0]:
            return []
    return list(node.operations.filter(status=Operation.Status.QUEUED).order_by("seq", "id"))


# The status written in, not a parameter: the open operations' index serves it (models.py).
_ANY_QUEUED = (
    "SELECT EXISTS (SELECT 1 FROM fleet_operation WHERE node_id = %s AND status = 'queued')"
)


def _loads_nothing(node: Node, queued: list[Operation]) -> bool:
    """Whether no queued operation loads weights: each is an unload, a load of versions all
    READY on the node already (a narrower version policy), or a pipeline's load whose steps
    are all READY at the versions it pins (Triton keeps serving the pipeline it replaces
    until the new one is loaded)."""
    ready = ready_in(node.index)

    def light(op: Operation) -> bool:
        if op.kind == Operation.Kind.UNLOAD or set(op.versions) <= ready.get(op.model_name, set()):
            return True
        steps = stored_steps(op.config or {})
        return bool(steps) and all(v in ready.get(name, set()) for name, v in steps)

    return all(light(op) for op in queued)


def _run_queued(
    node: Node,
    batch: list[Operation],
    wanted: "DesiredDigest",
    lease: Lease,
    *,
    last: bool = False,
) -> dict[str, dict | None]:
    """Returns the models loaded, with the config each was loaded with. With the `last` work
    under the lease, the lease is given back with the end of the last operation, unless more
    was queued meanwhile."""
    loaded: dict[str, dict | None] = {}
    # A batch at a time: each claim is conditional (queued -> running), so an operation
    # cancelled since the batch was read is skipped; a cancel reads the queue afresh. The next
    # operation is claimed with the end of the one before (one statement), once it may start;
    # the first, perhaps with the lease.
    claimed = lease.claimed  # the operation at hand, with what came before it
    while batch:
        for position, op in enumerate(batch):
            if not claimed:
                if _superseded(op, wanted):
                    _cancel_plan(op, "superseded: the desired state changed after it was planned")
                    break
                if not lease.held:
                    return loaded  # the heartbeat lost the node: another worker may own it now
            after = batch[position + 1] if position + 1 < len(batch) else None
            following = partial(_following, after, wanted, lease, last)
            status, claimed = _execute(node, op, claimed, following)
            if status == TAKEN:
                return loaded  # our lease lapsed, and the next owner goes on from here
            if status == Operation.Status.SUCCEEDED and op.kind != Operation.Kind.UNLOAD:
                loaded[op.model_name] = op.config
            if not _goes_on(op, status):
                step = f"step {op.seq} ({op.kind} {op.model_name})"
                _cancel_plan(op, f"not run: {step} {status}")
                if op.failure == failures.STUCK:
                    return loaded  # quarantined: no more work until a person or a restart
                break
        else:
            if claimed:  # the lease, with the batch's last end: nothing more was queued
                lease.let_go = True
                return loaded
        claimed = False
        batch = _next_batch(node)
    return loaded


def _superseded(op: Operation, wanted: "DesiredDigest") -> bool:
    """Whether `op` is a step of a plan for a desired state the node no longer has."""
    digest = wanted.digest()  # and the node's memory fields, as of a second ago at most
    return op.requested_by == RECONCILER and digest != op.plan_digest


def _following(
    op: Operation | None, wanted: "DesiredDigest", lease: Lease, last: bool
) -> Statement | None:
    """What is run with an operation's end, if the run goes on: the claim of the one after it
    (`op`) if it may start now (the node is still ours, and its plan still the node's); after
    the batch's last, on the `last` work under the lease, its release if nothing is queued."""
    if not lease.held:
        return None
    if op is None:
        return lease.let_go_when_idle() if last else None
    return None if _superseded(op, wanted) else _claim(op)


def _goes_on(op: Operation, status: str) -> bool:
    """Whether the run goes on after `op` ended with `status`: not after a load that hung (its
    node is quarantined); later steps of a make-before-break plan assume this one worked; a
    person's operations run whatever came before."""
    if op.failure == failures.STUCK:
        return False
    return op.requested_by != RECONCILER or status == Operation.Status.SUCCEEDED


def _cancel_plan(op: Operation, why: str) -> None:
    """Cancel what is still queued of `op`'s plan; people's own operations stay queued."""
    Operation.objects.filter(
        node_id=op.node_id,
        status=Operation.Status.QUEUED,
        requested_by=RECONCILER,
        plan_digest=op.plan_digest,
    ).update(status=Operation.Status.CANCELLED, finished_at=timezone.now(), error=why)


class DesiredDigest:
    """The digest of the node's desired state, and the node's memory fields, looked at again
    once a second at most: a load takes longer than that on a real node, and a plan's quick
    steps need not each pay for a look (`node_desired` recomputes only when what it is computed
    from changed). Seeded by a reconcile, it also carries the operations it planned, and looks
    again with the other nodes planned with it (`Looks`)."""

    RECHECK_S = 1.0

    def __init__(self, looks: "Looks | None" = None) -> None:
        self.node: Node | None = None
        self.value: str | None = None
        self.looked = -self.RECHECK_S
        self.planned: list[Operation] = []
        self.looks = looks

    def seed(self, node: Node, digest: str, planned: list[Operation]) -> None:
        """What a reconcile just planned from, and planned: the run starts from them instead
        of looking again. Each operation's node is `node`."""
        self.node, self.value, self.looked = node, digest, time.monotonic()
        self.planned = planned
        if self.looks is not None:
            self.looks.nodes[node.pk] = node

    def digest(self) -> str | None:
        assert self.node is not None
        if time.monotonic() - self.looked < self.RECHECK_S:
            return self.value
        self.looked = time.monotonic()
        if self.looks is not None:
            self.value = self.looks.digest(self.node)
            return self.value
        # A limit may have been set since the run read the node (a long plan, or a limit set
        # just as the plan was made).
        self.node.refresh_from_db(fields=["memory_limit_mb", "gpus"])
        try:
            self.value = node_desired(self.node).plan_digest
        except DesiredStateError:
            self.value = None
        return self.value


class Looks:
    """The looks again of the nodes planned together (a chunk, run one after another), taken
    for all of them at once: their memory fields and desired states in two statements, once a
    second at most, rather than two statements for each node whose run starts a second or more
    after the plan."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.digests: dict[int, str | None] = {}
        self.looked = -DesiredDigest.RECHECK_S

    def digest(self, node: Node) -> str | None:
        if time.monotonic() - self.looked >= DesiredDigest.RECHECK_S:
            self.looked = time.monotonic()
            self._look()
        return self.digests.get(node.pk)

    def _look(self) -> None:
        fields = Node.objects.filter(pk__in=self.nodes).values_list("pk", "memory_limit_mb", "gpus")
        for pk, limit, gpus in fields:
            self.nodes[pk].memory_limit_mb, self.nodes[pk].gpus = limit, gpus
        for pk, desired in nodes_desired(list(self.nodes.values())).items():
            if isinstance(desired, DesiredStateError):
                self.digests[pk] = None
            else:
                self.digests[pk] = desired.plan_digest


# What is run with the end of the operation at hand (_following); asked as it ends.
Following = Callable[[], Statement | None]


def _execute(node: Node, op: Operation, claimed: bool, following: Following) -> tuple[str, bool]:
    """Send one operation (`claimed` already, or claimed now) and read the node back; returns
    the status it ended with (TAKEN: another worker declared it lost before it ended), and
    whether what follows it (`following`: the next claim, or the lease's release) was done
    with its end."""
    if not claimed:
        with prepared_cursor() as cursor:
            cursor.execute(*_claim(op))
            if cursor.rowcount != 1:
                return Operation.Status.CANCELLED, False
    client = TritonClient.of(node)
    measured: tuple[int, float] | None = None
    try:
        if op.kind == Operation.Kind.UNLOAD:
            # Never unload_dependents: that would take down ensembles we may not manage. The
            # planner unloads our own ensembles by name, before their steps.
            client.unload(op.model_name)
        else:
            if memory.aware(node):
                refused, measured = _memory_check(node, client, op)
                refused = "" if op.override else refused  # a person vouched for the room
                if refused:
                    return _finish(op, following, refused, failure=failures.MEMORY)
            client.load(op.model_name, config_json=_json(op.config))
    except TritonTimeout as exc:
        dropped = isinstance(exc, TritonDropped)
        if (
            op.kind != Operation.Kind.UNLOAD
            and not dropped
            and (hung := quarantine.stuck(client, op))
        ):
            said = quarantine.quarantine(node, hung)
            return _finish(op, following, said, failure=failures.STUCK)
        # Sent, but no answer: Triton may still be at it. Never re-sent blindly; the
        # reconciler reads the node's index and decides.
        why = "sent, and the connection closed before an answer" if dropped else "no answer in time"
        return _finish(
            op,
            following,
            f"{why}: {exc.message}",
            Operation.Status.UNKNOWN,
            failure=failures.TIMEOUT,
        )
    except TritonUnreachable:
        # Not sent (connection refused): back in the queue, and the task retries with backoff;
        # only from running, as in _finish.
        Operation.objects.filter(pk=op.pk, status=Operation.Status.RUNNING).update(
            status=Operation.Status.QUEUED
        )
        raise
    except TritonRejected as exc:
        return _finish(op, following, exc.message)
    try:
        error = read_back(client, op)
    except TritonError as exc:
        return _finish(
            op,
            following,
            f"sent, but the index could not be read back: {exc}",
            Operation.Status.UNKNOWN,
        )
    if measured is not None and not error:
        try:
            memory.measure(node, client, op.model_name, *measured)
        except TritonError:  # no footprint this time; the load itself is done
            log.warning("node %s: no memory reading after loading %s", node.name, op.model_name)
    return _finish(op, following, error)


def _memory_check(
    node: Node, client: TritonClient, op: Operation
) -> tuple[str, tuple[int, float] | None]:
    """Before a load on a memory-aware node: why it does not fit ("" if it does), and the
    (version, memory in use now) to measure it by, when it adds one version still measured and
    nothing else changes meanwhile: it ends no version, and no unload is still under way (Triton
    ends versions in the background, and their memory comes back during the measurement)."""
    index = client.repository_index()
    ready = ready_in(index)
    adding = set(op.versions) - ready.get(op.model_name, set())
    refused = memory.refusal(node, op.model_name, adding, ready)
    ending = ready.get(op.model_name, set()) - set(op.versions)
    unloading = any(entry.state == "UNLOADING" for entry in index)
    if refused or len(adding) != 1 or ending or unloading:
        return refused, None
    (version,) = adding
    if not memory.measuring(node, op.model_name, version):
        return "", None
    before = memory.used_mb(node)
    return "", None if before is None else (version, before)


def read_back(client: TritonClient, op: Operation) -> str:
    """Empty when the index shows exactly what the operation promised, else what it shows."""
    entries = [e for e in client.repository_index() if e.model == op.model_name]
    ready = sorted(ready_in(entries).get(op.model_name, set()))
    if ready == sorted(op.versions):
        return ""
    listed = {e.version for e in entries}
    reasons = "; ".join(
        [f"v{e.version} {e.state} {e.reason}".strip() for e in entries if e.state != "READY"]
        + [  # Triton loads the versions it finds, silently: say where to look
            f"Triton did not find v{v}: does the node's model repository hold {op.model_name}/{v}/?"
            for v in sorted(op.versions)
            if v not in listed
        ]
    )
    return f"index shows READY {ready}, expected {sorted(op.versions)}" + (
        f" ({reasons})" if reasons else ""
    )


# What _finish returns when another worker declared the operation lost first: its end is theirs
# to record (the reconciler reads the node), and this worker no longer owns the node.
TAKEN = "taken"


def _finish(
    op: Operation, following: Following, error: str, status: str = "", failure: str = ""
) -> tuple[str, bool]:
    """Record how the operation ended; a failure is classified (`failure`, or from `error`) and,
    if transient, given a time to be tried again. What follows it (`following()`, asked now) is
    run with it if the run goes on. Returns its status (or TAKEN), and whether what followed
    changed a row."""
    status = status or (Operation.Status.FAILED if error else Operation.Status.SUCCEEDED)
    now = timezone.now()
    op.failure = failure or (failures.classify(error) if error else "")
    retry_at = None
    if status == Operation.Status.FAILED:
        retry_at = failures.retry_at(op.failure, _tries(op), now)
        if retry_at is not None:
            error += f" (tried again at {retry_at:%H:%M:%S} UTC)"
    # Only from running: another worker may have declared this operation lost meanwhile, and
    # then neither its status nor the trail may say what this worker saw, nor may it claim
    # more. The end, its event and what follows are one statement on PostgreSQL.
    at = connection.ops.adapt_datetimefield_value
    ending = (
        _END,
        (status, error, at(now), op.failure, at(retry_at), op.pk, Operation.Status.RUNNING),
    )
    event = audit_event(
        actor=op.requested_by,
        action=f"operation.{op.kind}",
        target=f"node:{op.node.name}:{op.model_name}",
        after={"versions": op.versions, "digest": op.config_digest},
        result="ok" if status == Operation.Status.SUCCEEDED else "failed",
        message=error,
    )
    # A load of a model the node owns changes nothing: while this operation is open no
    # reconcile prunes the node's models, so `owned` as read with the operation still holds.
    loaded = op.kind != Operation.Kind.UNLOAD
    owning = status == Operation.Status.SUCCEEDED and loaded != (op.model_name in op.node.owned)
    then = following() if _goes_on(op, status) else None
    with transaction.atomic() if owning else nullcontext():
        ended_here, followed = audit_update(ending, event, then)
        if not ended_here:
            log.warning("node %s: operation %s was taken over before it ended", op.node_id, op.pk)
            return TAKEN, False
        if owning:
            _own(op.node, op.model_name, loaded)
    return status, bool(followed)


def _claim(op: Operation) -> Statement:
    """`op` taken from the queue if still there (not cancelled), at the database's moment."""
    if connection.vendor == "postgresql":
        return _CLAIM, (Operation.Status.RUNNING, op.pk, Operation.Status.QUEUED)
    now = connection.ops.adapt_datetimefield_value(timezone.now())  # SQLite: one host's
    status = (Operation.Status.RUNNING, now, op.pk, Operation.Status.QUEUED)
    return _CLAIM.replace("statement_timestamp()", "%s"), status


# An operation's end and the claim of the next, each conditional on the status it leaves, are
# a release's most frequent statements: written out once (audit_update's `Statement`).
_END = """
UPDATE fleet_operation SET status = %s, error = %s, finished_at = %s, failure = %s, retry_at = %s
WHERE id = %s AND status = %s
"""
_CLAIM = """
UPDATE fleet_operation SET status = %s, started_at = statement_timestamp(), attempts = attempts + 1
WHERE id = %s AND status = %s
"""


def _tries(op: Operation) -> int:
    """This failure and those of the same load before it, since the model last loaded here."""
    same = Operation.objects.filter(node_id=op.node_id, model_name=op.model_name)
    since = (
        same.filter(status=Operation.Status.SUCCEEDED)
        .order_by("-finished_at")
        .values_list("finished_at", flat=True)
        .first()
    )
    failed = same.filter(status=Operation.Status.FAILED, config_digest=op.config_digest)
    return 1 + (failed.filter(finished_at__gt=since) if since else failed).count()


def _own(node: Node, model_name: str, owned: bool) -> None:
    """What we loaded is ours to unload; what we unloaded is no longer ours."""
    locked = Node.objects.select_for_update().get(pk=node.pk)
    names = set(locked.owned)
    save_owned(locked, names | {model_name} if owned else names - {model_name})
    node.owned = locked.owned


def save_owned(node: Node, names: set[str]) -> None:
    """Write the (locked) node's owned models, when they changed."""
    if names != set(node.owned):
        node.owned = sorted(names)
        node.save(update_fields=["owned"])


def _json(config: object) -> str | None:
    return json.dumps(config) if config is not None else None
