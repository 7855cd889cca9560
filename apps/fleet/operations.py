"""Converging nodes: plan operations from desired vs observed state, then run them one at a time per
node, each confirmed by reading the node's repository index back."""

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Case, Exists, F, OuterRef, Q, QuerySet, TextField, Value, When, Window
from django.db.models.functions import Cast, RowNumber
from django.utils import timezone

from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet import failures, memory
from apps.fleet.desired import (
    Desired,
    DesiredStateError,
    node_desired,
    plan_digest,
    targeting,
)
from apps.fleet.models import Deployment, Node, Operation
from apps.fleet.planner import Observed, plan
from apps.fleet.polling import node_read_index
from apps.fleet.routing import drained, warm_up
from apps.fleet.triton import (
    TritonClient,
    TritonError,
    TritonRejected,
    TritonTimeout,
    TritonUnreachable,
)
from apps.registry.codec import ensemble_steps, from_dict
from apps.registry.models import Model

log = logging.getLogger(__name__)
OPEN = (Operation.Status.QUEUED, Operation.Status.RUNNING)
RECONCILER = "system:reconciler"


def observed_state(node: Node) -> dict[str, Observed]:
    """The node's last index read, plus what our own operations last did to each model."""
    ready: dict[str, set[int]] = {}
    busy: set[str] = set()
    for entry in node.index:
        ready.setdefault(entry["model"], set())
        if entry.get("state") == "READY" and entry.get("version") is not None:
            ready[entry["model"]].add(int(entry["version"]))
        elif entry.get("state") in ("LOADING", "UNLOADING"):
            busy.add(entry["model"])
    now = timezone.now()
    rows = _history(node, now)
    # Positions in each model's history: an operation counts if it came after the model's last
    # success (which clears earlier failures), and the later of two wins.
    since = {row.model: row.position for row in rows if row.status == Operation.Status.SUCCEEDED}
    last_ok: dict[str, tuple[int, str]] = {}
    failed: dict[str, set[str]] = {}
    for row in rows:
        after = row.position > since.get(row.model, 0)
        if row.status == Operation.Status.FAILED:
            if after and row.held:  # remembered until its retry_at, if it has one
                failed.setdefault(row.model, set())
                if row.latest:  # the last try of this config decides
                    failed[row.model].add(row.digest)
            continue
        # Its worker died after sending it: if the node shows what it asked for, it took.
        took = (
            row.status == Operation.Status.SUCCEEDED or ready.get(row.model, set()) == row.versions
        )
        if took and row.position > last_ok.get(row.model, (0, ""))[0]:
            last_ok[row.model] = (row.position, row.digest)
    return {
        name: Observed(
            ready=frozenset(versions),
            busy=name in busy,
            digest=last_ok.get(name, (0, ""))[1],
            failed=frozenset(failed.get(name, ())),
        )
        for name, versions in ready.items()
    } | {
        name: Observed(frozenset(), digest="", failed=frozenset(digests))
        for name, digests in failed.items()
        if name not in ready
    }


class _Done(NamedTuple):
    model: str
    status: str
    versions: set[int]
    digest: str
    position: int  # in the model's history on the node, from 1, by finished_at then id
    latest: bool  # the last of its kind: see _history
    held: bool  # a failure not to be tried again yet


def _history(node: Node, now: datetime) -> list[_Done]:
    """What `observed_state` needs of the node's finished operations, in one query whose rows
    do not grow with its history: per model, its last success, its last unknown for each set
    of versions asked, its last failure of each config, and its last failure still held back
    at `now`."""
    done = [Operation.Status.SUCCEEDED, Operation.Status.FAILED, Operation.Status.UNKNOWN]
    failed = Q(status=Operation.Status.FAILED)
    held = failed & (Q(retry_at__isnull=True) | Q(retry_at__gt=now))
    # Descending is the ascending order reversed on every database, NULLs included.
    newest = [F("finished_at").desc(), F("id").desc()]
    kind = Case(
        When(status=Operation.Status.UNKNOWN, then=Cast("versions", TextField())),
        When(failed, then=F("config_digest")),
        default=Value(""),
        output_field=TextField(),
    )
    rows = (
        node.operations.filter(status__in=done)
        .annotate(held=Case(When(held, then=Value(True)), default=Value(False)))
        .annotate(
            position=Window(
                RowNumber(),
                partition_by=[F("model_name")],
                order_by=[F("finished_at").asc(), F("id").asc()],
            ),
            nth=Window(
                RowNumber(), partition_by=[F("model_name"), F("status"), kind], order_by=newest
            ),
            nth_held=Window(
                RowNumber(), partition_by=[F("model_name"), F("held")], order_by=newest
            ),
        )
        .filter(Q(nth=1) | Q(nth_held=1, held=True))
        .values_list("model_name", "status", "versions", "config_digest", "position", "nth", "held")
    )
    return [
        _Done(model, status, set(versions), digest, position, nth == 1, bool(held))
        for model, status, versions, digest, position, nth, held in rows
    ]


def node_reconcile(*, node_id: int, wanted: "Wanted | None" = None) -> list[Operation]:
    """Read the node and plan what is missing. Returns what the caller runs now (node_run,
    handed `wanted`: what the plan was made from, not computed twice): the operations just
    planned, or open ones whose run was lost. Harmless to repeat: a node with queued or running
    operations is left to them, and a converged node gets no operation at all."""
    node = node_read_index(node_id=node_id)
    if node.health == Node.Health.UNREACHABLE or node.last_error:
        return []
    try:
        desired = node_desired(node)
    except DesiredStateError as exc:
        log.warning("node %s: %s", node.name, exc)
        return []
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node_id)
        if locked.operations.filter(status__in=OPEN).exists():
            # Work is pending. If no worker has held the node for longer than a lease since it was
            # queued, its run was lost (a killed worker's unacknowledged task comes back only
            # after the visibility timeout): hand it to the caller. Younger work is about to be
            # taken; running it too would only find the node busy.
            now = timezone.now()
            stale = now - timedelta(seconds=settings.FLEET_LEASE_S)
            free = locked.lease_until is None or locked.lease_until < now
            lost = locked.operations.filter(status__in=OPEN, created_at__lt=stale)
            return list(lost) if free else []
        observed = observed_state(node)
        owned = _drained(locked, desired, observed)
        # Only what this product owns may be unloaded: a model someone else loaded (even one we
        # loaded long ago and have since let go) stays until a person adopts it.
        managed = {name: model.ensemble for name, model in desired.items()}
        if drained := owned - set(desired):
            ensembles = Model.objects.filter(name__in=drained, kind=Model.Kind.ENSEMBLE)
            kinds = set(ensembles.values_list("name", flat=True))
            managed |= {name: name in kinds for name in drained}
        room = None
        if memory.aware(node):
            ready = {name: set(seen.ready) for name, seen in observed.items()}
            coming = {(m.name, v) for m in desired.values() for v in m.versions}
            room = memory.room(node, ready, coming)
        actions = plan(desired, observed, managed, room)
        digest = plan_digest(desired)
        if wanted is not None:
            wanted.seed(node, digest)
        if actions and not REQUEST_ID.get():
            _follow_the_change(locked, digest)
        ops = Operation.objects.bulk_create(
            Operation(
                node=locked,
                kind=action.kind,
                model_name=action.model,
                versions=list(action.versions),
                config=action.config,
                config_digest=action.digest,
                plan_digest=digest,
                seq=seq,
                requested_by=RECONCILER,
            )
            for seq, action in enumerate(actions)
        )
        if ops:
            _record_drift(node, [str(op) for op in ops])
    return ops


def _follow_the_change(node: Node, digest: str) -> None:
    """A periodic reconcile that carries out a new desired state records it under the request
    that changed it (the newest deployment targeting the node), as that request's own reconcile
    would have; a repair of the same desired state as the last plan is nobody's request."""
    last = node.operations.exclude(plan_digest="").order_by("-id")
    if last.values_list("plan_digest", flat=True).first() == digest:
        return
    newest = targeting(node).order_by("-updated_at").values_list("request_id", flat=True).first()
    if newest:
        REQUEST_ID.set(newest)  # for the rest of this task: the plan's events and its run


def _drained(node: Node, desired: Desired, observed: dict[str, Observed]) -> set[str]:
    """The node's owned models, less those no deployment names and that are gone from it: they
    are drained, and if someone loads one of them again it is theirs. Call under the row lock."""
    owned = {
        name for name in node.owned if name in desired or observed.get(name, _GONE).ready
    } | set(desired)
    _save_owned(node, owned)
    return owned


_GONE = Observed(frozenset())


def _record_drift(node: Node, operations: list[str]) -> None:
    """One `node.drift` event per drift: the same repair planned again within FLEET_FLAP_WINDOW_S
    (something outside keeps undoing it) is not recorded again; its operations still are."""
    target = f"node:{node.name}"
    since = timezone.now() - timedelta(seconds=settings.FLEET_FLAP_WINDOW_S)
    last = (
        AuditEvent.objects.filter(action="node.drift", target=target, created_at__gte=since)
        .values_list("after", flat=True)
        .first()
    )
    if last is None or last.get("operations") != operations:
        audit_record(
            actor=RECONCILER, action="node.drift", target=target, after={"operations": operations}
        )


def rollback_windows_close() -> int:
    """Let go of every baseline whose rollback window has passed; the reconcile that follows
    narrows its nodes to the release itself. Returns how many closed."""
    with transaction.atomic():
        closing = list(
            Deployment.objects.filter(baseline_until__lt=timezone.now())
            .select_related("model", "pool", "node")
            .select_for_update(of=("self",))
        )
        for deployment in closing:
            kept = deployment.baseline_version
            deployment.baseline_version, deployment.baseline_until = None, None
            deployment.save(update_fields=["baseline_version", "baseline_until", "updated_at"])
            audit_record(
                actor=RECONCILER,
                action="deployment.window_closed",
                target=f"{deployment.target}:{deployment.model.name}",
                before={"version": deployment.version, "baseline": kept},
                after={"version": deployment.version},
            )
    return len(closing)


class Lease:
    """One worker's hold on a node. Short, and renewed by a heartbeat while the work goes on, so a
    worker killed with SIGKILL frees the node within FLEET_LEASE_S. If a renewal fails (the
    database was away longer than the lease), `held` turns false and the worker stops."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.owner = uuid.uuid4().hex
        self.seconds = settings.FLEET_LEASE_S
        self.held = False
        self._stop = threading.Event()

    def _extend(self, query: Q) -> bool:
        until = timezone.now() + timedelta(seconds=self.seconds)
        return bool(
            Node.objects.filter(query, pk=self.node_id).update(
                lease_owner=self.owner, lease_until=until
            )
        )

    def _heartbeat(self) -> None:
        try:
            while self.held and not self._stop.wait(self.seconds / 3):
                self.held = self._extend(Q(lease_owner=self.owner))
        except Exception:
            log.exception("node %s: lease renewal failed", self.node_id)
            self.held = False
        finally:
            connection.close()  # this thread's own connection

    @contextmanager
    def hold(self) -> Iterator["Lease"]:
        now = timezone.now()
        free = Q(lease_until__isnull=True) | Q(lease_until__lt=now)
        # A lapsed lease does not prove its worker dead: one cut off from the database (or
        # stalled) may still be waiting on a load it sent. Until that load can no longer be
        # answered, the node is busy: the next owner would send a second load beside it.
        self.held = self._extend(free & Q(~Exists(_may_still_run(now))))
        if not self.held:
            yield self
            return
        thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.node_id}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            Node.objects.filter(pk=self.node_id, lease_owner=self.owner).update(
                lease_owner="", lease_until=None
            )
            self.held = False


def _may_still_run(now: datetime) -> "QuerySet[Operation]":
    """The node's operations marked running whose worker may still be waiting on Triton: started
    less than a load's timeout ago (plus a connect's, for the reads before it)."""
    since = now - timedelta(seconds=settings.FLEET_LOAD_TIMEOUT_S + settings.TRITON_TIMEOUT_S)
    return Operation.objects.filter(
        node_id=OuterRef("pk"), status=Operation.Status.RUNNING, started_at__gt=since
    )


class NodeBusy(Exception):
    """Another worker holds the node, or may still be at it; try again shortly."""


def node_run(*, node_id: int, wanted: "Wanted | None" = None) -> None:
    """Run the node's queued operations in order, holding its lease; a plan's steps stop when
    the desired state they were planned for is no longer the node's (`wanted`, if the caller
    just planned them, knows what that was)."""
    with Lease(node_id).hold() as lease:
        if not lease.held:
            raise NodeBusy(node_id)
        # We hold the lease, so an operation still marked running lost its worker mid-way.
        Operation.objects.filter(node_id=node_id, status=Operation.Status.RUNNING).update(
            status=Operation.Status.UNKNOWN,
            finished_at=timezone.now(),
            error="the worker was lost mid-operation; the reconciler reads the node's state",
        )
        if wanted is None or wanted.node is None:
            wanted = Wanted()
            wanted.node = Node.objects.select_related("pool").get(pk=node_id)
        node = wanted.node
        queued = node.operations.filter(status=Operation.Status.QUEUED).select_related("node")
        if not queued.exists():
            return
        if _loads_nothing(node, queued):
            # A move back (a rollback inside the window, an abort, a fallback to a warm version)
            # or a pipeline switching to steps already loaded (a blue-green switch): every node
            # at once, in traffic, with nothing to warm up.
            _run_queued(node, queued, wanted, lease)
            return
        # Out of traffic, on a pool with a traffic strategy: loads never meet live requests.
        with drained(node):
            loaded = _run_queued(node, queued, wanted, lease)
            warm_up(node, loaded)


def _loads_nothing(node: Node, queued: "QuerySet[Operation]") -> bool:
    """Whether no queued operation loads weights: each is an unload, a load of versions all
    READY on the node already (a narrower version policy), or a pipeline's load whose steps
    are all READY at the versions it pins (Triton keeps serving the pipeline it replaces
    until the new one is loaded)."""
    ready = {model: set(versions) for model, versions in node.ready_versions.items()}

    def light(op: Operation) -> bool:
        if op.kind == Operation.Kind.UNLOAD or set(op.versions) <= ready.get(op.model_name, set()):
            return True
        steps = ensemble_steps(from_dict(op.config)) if op.config else []
        return bool(steps) and all(v in ready.get(name, set()) for name, v in steps)

    return all(light(op) for op in queued)


def _run_queued(
    node: Node, queued: "QuerySet[Operation]", wanted: "Wanted", lease: Lease
) -> dict[str, dict | None]:
    """Returns the models loaded, with the config each was loaded with."""
    loaded: dict[str, dict | None] = {}
    # A batch at a time: each claim is conditional (queued -> running), so an operation
    # cancelled since the batch was read is skipped; a cancel reads the queue afresh.
    while batch := list(queued.order_by("seq", "id")):
        for op in batch:
            if op.requested_by == RECONCILER and wanted.digest() != op.plan_digest:
                _cancel_plan(op, "superseded: the desired state changed after it was planned")
                break
            if not lease.held:
                return loaded  # the heartbeat lost the node: another worker may own it now
            status = _execute(node, op)
            if status == TAKEN:
                return loaded  # our lease lapsed, and the next owner goes on from here
            if status == Operation.Status.SUCCEEDED and op.kind != Operation.Kind.UNLOAD:
                loaded[op.model_name] = op.config
            if op.requested_by == RECONCILER and status != Operation.Status.SUCCEEDED:
                # Later steps of a make-before-break plan assume this one worked.
                step = f"step {op.seq} ({op.kind} {op.model_name})"
                _cancel_plan(op, f"not run: {step} {status}")
                break
    return loaded


def _cancel_plan(op: Operation, why: str) -> None:
    """Cancel what is still queued of `op`'s plan; people's own operations stay queued."""
    Operation.objects.filter(
        node_id=op.node_id,
        status=Operation.Status.QUEUED,
        requested_by=RECONCILER,
        plan_digest=op.plan_digest,
    ).update(status=Operation.Status.CANCELLED, finished_at=timezone.now(), error=why)


class Wanted:
    """The digest of the node's desired state, looked at again once a second at most: a load
    takes longer than that on a real node, and a plan's quick steps need not each pay for a
    look (`node_desired` recomputes only when what it is computed from changed)."""

    RECHECK_S = 1.0

    def __init__(self) -> None:
        self.node: Node | None = None
        self.value: str | None = None
        self.looked = -self.RECHECK_S

    def seed(self, node: Node, digest: str) -> None:
        """What a reconcile just planned from: the run starts from it instead of looking again."""
        self.node, self.value, self.looked = node, digest, time.monotonic()

    def digest(self) -> str | None:
        assert self.node is not None
        if time.monotonic() - self.looked < self.RECHECK_S:
            return self.value
        self.looked = time.monotonic()
        try:
            self.value = plan_digest(node_desired(self.node))
        except DesiredStateError:
            self.value = None
        return self.value


def _execute(node: Node, op: Operation) -> str:
    """Send one operation and read the node back; returns the status it ended with (TAKEN:
    another worker declared it lost before it ended)."""
    claimed = Operation.objects.filter(pk=op.pk, status=Operation.Status.QUEUED).update(
        status=Operation.Status.RUNNING, started_at=timezone.now(), attempts=op.attempts + 1
    )
    if claimed != 1:
        return Operation.Status.CANCELLED
    client = TritonClient(node.http_url, node=node.name)
    measured: tuple[int, float] | None = None
    try:
        if op.kind == Operation.Kind.UNLOAD:
            # Never unload_dependents: that would take down ensembles we may not manage. The
            # planner unloads our own ensembles by name, before their steps.
            client.unload(op.model_name)
        else:
            # As the node is now: its limit may have been set since the run read it (a long
            # plan, or a limit set just as the plan was made).
            node.refresh_from_db(fields=["memory_limit_mb", "gpus"])
            if memory.aware(node):
                refused, measured = _memory_check(node, client, op)
                refused = "" if op.override else refused  # a person vouched for the room
                if refused:
                    return _finish(op, refused, failure=failures.MEMORY)
            client.load(op.model_name, config_json=_json(op.config))
    except TritonTimeout as exc:
        # Sent, but no answer in time: Triton may still be at it. Never re-sent blindly; the
        # reconciler reads the node's index and decides.
        return _finish(
            op,
            f"no answer in time: {exc.message}",
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
        return _finish(op, exc.message)
    try:
        error = _read_back(client, op)
    except TritonError as exc:
        return _finish(
            op, f"sent, but the index could not be read back: {exc}", Operation.Status.UNKNOWN
        )
    if measured is not None and not error:
        try:
            memory.measure(node, client, op.model_name, *measured)
        except TritonError:  # no footprint this time; the load itself is done
            log.warning("node %s: no memory reading after loading %s", node.name, op.model_name)
    return _finish(op, error)


def _memory_check(
    node: Node, client: TritonClient, op: Operation
) -> tuple[str, tuple[int, float] | None]:
    """Before a load on a memory-aware node: why it does not fit ("" if it does), and the
    (version, memory in use now) to measure it by, when it adds one version still measured and
    nothing else changes meanwhile: it ends no version, and no unload is still under way (Triton
    ends versions in the background, and their memory comes back during the measurement)."""
    ready: dict[str, set[int]] = {}
    index = client.repository_index()
    for entry in index:
        if entry.state == "READY" and entry.version is not None:
            ready.setdefault(entry.model, set()).add(entry.version)
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


def _read_back(client: TritonClient, op: Operation) -> str:
    """Empty when the index shows exactly what the operation promised, else what it shows."""
    entries = [e for e in client.repository_index() if e.model == op.model_name]
    ready = sorted(e.version for e in entries if e.state == "READY" and e.version is not None)
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


def _finish(op: Operation, error: str, status: str = "", failure: str = "") -> str:
    """Record how the operation ended; a failure is classified (`failure`, or from `error`) and,
    if transient, given a time to be tried again. Returns its status, or TAKEN."""
    status = status or (Operation.Status.FAILED if error else Operation.Status.SUCCEEDED)
    now = timezone.now()
    failure = failure or (failures.classify(error) if error else "")
    retry_at = None
    if status == Operation.Status.FAILED:
        retry_at = failures.retry_at(failure, _tries(op), now)
        if retry_at is not None:
            error += f" (tried again at {retry_at:%H:%M:%S} UTC)"
    with transaction.atomic():
        # Only from running: another worker may have declared this operation lost meanwhile,
        # and then neither its status nor the trail may say what this worker saw.
        ended = Operation.objects.filter(pk=op.pk, status=Operation.Status.RUNNING).update(
            status=status, error=error, finished_at=now, failure=failure, retry_at=retry_at
        )
        if ended != 1:
            log.warning("node %s: operation %s was taken over before it ended", op.node_id, op.pk)
            return TAKEN
        # A load of a model the node owns changes nothing: while this operation is open no
        # reconcile prunes the node's models, so `owned` as read with the operation still holds.
        loaded = op.kind != Operation.Kind.UNLOAD
        if status == Operation.Status.SUCCEEDED and loaded != (op.model_name in op.node.owned):
            _own(op.node_id, op.model_name, loaded)
        audit_record(
            actor=op.requested_by,
            action=f"operation.{op.kind}",
            target=f"node:{op.node.name}:{op.model_name}",
            after={"versions": op.versions, "digest": op.config_digest},
            result="ok" if status == Operation.Status.SUCCEEDED else "failed",
            message=error,
        )
    return status


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


def _own(node_id: int, model_name: str, owned: bool) -> None:
    """What we loaded is ours to unload; what we unloaded is no longer ours."""
    node = Node.objects.select_for_update().get(pk=node_id)
    _save_owned(node, set(node.owned) | {model_name} if owned else set(node.owned) - {model_name})


def _save_owned(node: Node, names: set[str]) -> None:
    """Write the (locked) node's owned models, when they changed."""
    if names != set(node.owned):
        node.owned = sorted(names)
        node.save(update_fields=["owned"])


def _json(config: object) -> str | None:
    return json.dumps(config) if config is not None else None
