"""Converging a node, the first half: read it, compare what it serves with its desired state,
and plan the operations that are missing (make before break: apps/fleet/planner.py). The
runner (apps/fleet/runner.py) carries them out."""

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, Subquery
from django.db.models.functions import Now
from django.utils import timezone

from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.audit.services import audit_append, audit_event, audit_record
from apps.fleet import memory, quarantine
from apps.fleet.desired import Desired, DesiredStateError, nodes_desired
from apps.fleet.join import join
from apps.fleet.models import Deployment, Node, Operation
from apps.fleet.planner import Action, Observed, plan
from apps.fleet.polling import nodes_read_index
from apps.fleet.runner import RECONCILER, DesiredDigest, Looks
from apps.fleet.triton import ready_in
from apps.registry.models import Model
from apps.web.bulk import bulk_insert
from apps.web.clock import database_now

log = logging.getLogger(__name__)


def observed_state(node: Node, rows: "list[_Done] | None" = None) -> dict[str, Observed]:
    """The node's last index read, plus what our own operations last did to each model (`rows`,
    its `_histories`, when read already)."""
    # Every model the index lists, READY in no version or in some.
    ready: dict[str, set[int]] = {entry["model"]: set() for entry in node.index}
    ready |= ready_in(node.index)
    busy = {e["model"] for e in node.index if e.get("state") in ("LOADING", "UNLOADING")}
    if rows is None:
        rows = _histories([node.pk], timezone.now()).get(node.pk, [])
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
    late: bool  # ended at or after the `since` of _histories


# The window query of _histories, written once: built with the ORM, it was compiled afresh for
# every reconcile of every node, a sixth of the CPU of a node's reconcile and run. Per node and
# model:
# each operation's place in the model's history (`position`), its rank among the model's
# operations of the same status and kind (the set of versions for an unknown, the config for a
# failure; `nth`), and among those held back or not (`nth_held`); and whether it ended at or after
# a moment (`late`): the node's newest operation is always among the rows, so none of them late
# means none ended since. Descending is the ascending order reversed on every database, NULLs
# included.
_HISTORY = """
SELECT node_id, model_name, status, versions, config_digest, "position", nth, held, late FROM (
    SELECT node_id, model_name, status, versions, config_digest, held, late,
        ROW_NUMBER() OVER (
            PARTITION BY node_id, model_name ORDER BY finished_at ASC, id ASC
        ) AS "position",
        ROW_NUMBER() OVER (
            PARTITION BY node_id, model_name, status, CASE
                WHEN status = %s THEN CAST(versions AS TEXT)
                WHEN status = %s THEN config_digest
                ELSE '' END
            ORDER BY finished_at DESC, id DESC
        ) AS nth,
        ROW_NUMBER() OVER (
            PARTITION BY node_id, model_name, held ORDER BY finished_at DESC, id DESC
        ) AS nth_held
    FROM (
        SELECT *, CASE WHEN status = %s AND (retry_at IS NULL OR retry_at > %s)
            THEN 1 ELSE 0 END AS held,
            CASE WHEN finished_at >= %s THEN 1 ELSE 0 END AS late
        FROM fleet_operation WHERE node_id IN ({nodes}) AND status IN (%s, %s, %s)
    ) done
) ranked
WHERE nth = 1 OR (nth_held = 1 AND held = 1)
"""


def _histories(
    node_ids: list[int], now: datetime, since: datetime | None = None
) -> dict[int, list[_Done]]:
    """What `observed_state` needs of each node's finished operations, in one query whose rows
    do not grow with their history: per node and model, its last success, its last unknown for
    each set of versions asked, its last failure of each config, and its last failure still
    held back at `now`; each row says whether it ended at or after `since` (`now` if None)."""
    status, at = Operation.Status, connection.ops.adapt_datetimefield_value(now)
    late = connection.ops.adapt_datetimefield_value(since or now)
    kinds = (status.UNKNOWN, status.FAILED)
    done = (status.SUCCEEDED, status.FAILED, status.UNKNOWN)
    histories: dict[int, list[_Done]] = {}
    if not node_ids:
        return histories
    statement = _HISTORY.format(nodes=", ".join(["%s"] * len(node_ids)))
    with connection.cursor() as cursor:
        cursor.execute(statement, (*kinds, status.FAILED, at, late, *node_ids, *done))
        rows = cursor.fetchall()
    for node_id, model, ended, versions, digest, position, nth, held, after in rows:
        histories.setdefault(node_id, []).append(
            _Done(
                model,
                ended,
                set(json.loads(versions)),  # JSON text on both databases, as Django reads it
                digest,
                position,
                nth == 1,
                bool(held),
                bool(after),
            )
        )
    return histories


def _plannable(node: Node) -> bool:
    """Whether the node, its index just read, is planned for: not while unreachable, departed or
    quarantined (until a person or a restart clears it: then it joins again, and is)."""
    if node.health == Node.Health.UNREACHABLE or node.last_error:
        return False
    if node.stage == Node.Stage.DEPARTED:
        return False
    if node.stage == Node.Stage.QUARANTINED:
        if not quarantine.restarted(node):
            return False
        node.refresh_from_db(fields=["stage"])  # released: joining
    return True


class Planned(NamedTuple):
    """What a node's reconcile hands its run: the operations to run now, what they were planned
    from (the run starts from it rather than looking again), the request they are recorded
    under ("" for none of their own), and the desired state they serve (None for a lost run's:
    it was planned by another reconcile)."""

    ops: list[Operation]
    wanted: DesiredDigest
    request: str
    desired: Desired | None = None


def node_reconcile(*, node_id: int) -> list[Operation]:
    """`nodes_reconcile` of one node; the request its plan is recorded under, if any, is this
    context's from now on (its run's)."""
    planned = nodes_reconcile([node_id]).get(node_id)
    if planned is None:
        return []
    if planned.request:
        REQUEST_ID.set(planned.request)
    return planned.ops


def nodes_reconcile(node_ids: list[int]) -> dict[int, Planned]:
    """Read the nodes and plan what is missing on each, in one transaction. Returns, by node,
    what the caller runs now (node_run, handed `wanted`): the operations just planned, or open
    ones whose run was lost. Harmless to repeat: a node with queued or running operations is
    left to them, and a converged node gets no operation at all. A node whose operation ended
    while its index was read (its run, between our read and our lock) is left to the next pass:
    planned from what it served before, a load that just read back READY would be sent again."""
    reading = timezone.now()
    read = [node for node in nodes_read_index(node_ids) if _plannable(node)]
    if not read:
        return {}
    nodes: list[tuple[Node, Desired]] = []
    for node, desired in zip(read, nodes_desired(read).values(), strict=True):
        if isinstance(desired, DesiredStateError):
            log.warning("node %s: %s", node.name, desired)
        else:
            nodes.append((node, desired))
    planned: dict[int, Planned] = {}
    joining: list[tuple[Node, Desired]] = []
    with transaction.atomic():
        locked = _locked([node.pk for node, _ in nodes])  # less those removed meanwhile
        now = database_now()  # leases are the database's (apps/web/clock.py)
        idle = [pk for pk, row in locked.items() if not row.pending]  # type: ignore[attr-defined]
        histories = _histories(idle, now, since=reading)
        pruned: dict[tuple[str, ...], list[int]] = {}  # nodes by their owned models, changed
        drifts: list[AuditEvent | None] = []
        looks = Looks()  # the runs of these plans look again together
        for node, desired in nodes:
            if (row := locked.get(node.pk)) is None:
                continue
            if row.pending:  # type: ignore[attr-defined]
                if lost := _lost(row, now):
                    wanted = DesiredDigest()
                    wanted.node = row
                    planned[node.pk] = Planned(lost, wanted, "")
                continue
            rows = histories.get(node.pk, [])
            if any(done.late for done in rows):
                continue  # its index may predate what ended: read again next pass
            observed = observed_state(node, rows)
            owned = list(row.owned)
            plan, drift = _plan(node, row, desired, observed, looks)
            if row.owned != owned:
                pruned.setdefault(tuple(row.owned), []).append(row.pk)
            if plan.ops:
                planned[node.pk] = plan
                drifts.append(drift)
            elif node.stage == Node.Stage.JOINING:
                joining.append((node, desired))
        # A statement per set of models owned (a pool's nodes own the same): a bulk_update
        # builds a CASE a node, which cost more than the plan.
        for names, pks in pruned.items():
            Node.objects.filter(pk__in=pks).update(owned=list(names))
        bulk_insert([op for plan in planned.values() for op in plan.ops if not op.pk])
        audit_append([event for event in drifts if event])
    for node, desired in joining:
        join(node, desired)  # polled in full by nodes_read_index, as every joining node is
    return planned


def _plan(
    node: Node, row: Node, desired: Desired, observed: dict[str, Observed], looks: Looks
) -> tuple[Planned, AuditEvent | None]:
    """The node's plan (its operations not written yet), and the drift event it is recorded
    with, if any (_drift). `row` is the node's locked row; its owned models are pruned. Its
    run looks again with the others' (`looks`)."""
    actions = _actions(node, row, desired, observed)
    digest = desired.plan_digest
    # A plan for a desired state the node was not planned for before is a change's; one for
    # the same state again, a repair's.
    changed = digest != row.last_plan  # type: ignore[attr-defined]
    # A periodic reconcile that carries out a new desired state records it under the request
    # that changed it (the newest deployment targeting the node), as that request's own
    # reconcile would have; a repair is nobody's request.
    request = ""
    newest: str | None = row.newest_request  # type: ignore[attr-defined]
    if actions and changed and newest and not REQUEST_ID.get():
        request = newest
    ops = [
        Operation(
            node=row,
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
    ]
    wanted = DesiredDigest(looks)
    wanted.seed(row, digest, ops)  # read under the lock: its owned models as pruned
    drift = None
    if ops:
        with _request(request):
            drift = _drift(node, [str(op) for op in ops], repair=not changed)
    return Planned(ops, wanted, request, desired), drift


def _locked(node_ids: list[int]) -> dict[int, Node]:
    """The nodes' rows, locked (Node.objects.lock: never in a deadlock with another chunk's), with
    their pools for the runs these plans are handed to (`wanted`: the balancer, the warm-up),
    whether work is pending on each (`pending`), and what a plan is recorded with (`last_plan`,
    whether it repeats a repair: _drift; `newest_request`, the request of the newest deployment
    targeting it). Locked first, then read: a statement that waited for a lock sees what was
    committed when it began (READ COMMITTED), so a plan committed meanwhile by the worker it
    waited for would not be pending in its eyes, and the node would be planned twice."""
    Node.objects.filter(pk__in=node_ids).lock()
    pending = Operation.objects.filter(node=OuterRef("pk"), status__in=Operation.OPEN)
    planned = Operation.objects.filter(node=OuterRef("pk")).exclude(plan_digest="")
    newest = Deployment.objects.filter(Q(pool_id=OuterRef("pool_id")) | Q(node=OuterRef("pk")))
    rows = (
        Node.objects.select_related("pool")
        .annotate(
            pending=Exists(pending),
            last_plan=Subquery(planned.order_by("-id").values("plan_digest")[:1]),
            newest_request=Subquery(newest.order_by("-updated_at").values("request_id")[:1]),
        )
        .filter(pk__in=node_ids)
    )
    return {row.pk: row for row in rows}


def _lost(row: Node, now: datetime) -> list[Operation]:
    """A node's pending work, if its run was lost: no worker has held the node for longer than a
    lease since it was queued (a killed worker's unacknowledged task comes back only after the
    visibility timeout). Younger work is about to be taken; running it too would only find the
    node busy."""
    if row.lease_until is not None and row.lease_until >= now:
        return []
    stale = now - timedelta(seconds=settings.FLEET_LEASE_S)
    return list(row.operations.filter(status__in=Operation.OPEN, created_at__lt=stale))


def _actions(
    node: Node, row: Node, desired: Desired, observed: dict[str, Observed]
) -> list[Action]:
    """What the node (`row`, locked) needs to serve `desired`, make before break."""
    owned = _pruned(row, desired, observed)
    # Only what this product owns may be unloaded: a model someone else loaded (even one we
    # loaded long ago and have since let go) stays until a person adopts it.
    managed = {name: model.ensemble for name, model in desired.items()}
    if draining := owned - set(desired):
        ensembles = Model.objects.filter(name__in=draining, kind=Model.Kind.ENSEMBLE)
        kinds = set(ensembles.values_list("name", flat=True))
        managed |= {name: name in kinds for name in draining}
    room = None
    if memory.aware(node):
        ready = {name: set(seen.ready) for name, seen in observed.items()}
        coming = {(m.name, v) for m in desired.values() for v in m.versions}
        room = memory.room(node, ready, coming)
    return plan(desired, observed, managed, room)


@contextmanager
def _request(request: str) -> Iterator[None]:
    """Events recorded meanwhile are `request`'s, when it names one."""
    token = REQUEST_ID.set(request) if request else None
    try:
        yield
    finally:
        if token is not None:
            REQUEST_ID.reset(token)


def _pruned(node: Node, desired: Desired, observed: dict[str, Observed]) -> set[str]:
    """The node's owned models, less those no deployment names and that are gone from it: they
    are drained, and if someone loads one of them again it is theirs. Set on the (locked) row,
    for its caller to save."""
    owned = {
        name for name in node.owned if name in desired or observed.get(name, _GONE).ready
    } | set(desired)
    if owned != set(node.owned):
        node.owned = sorted(owned)
    return owned


_GONE = Observed(frozenset())


def _drift(node: Node, operations: list[str], *, repair: bool = True) -> AuditEvent | None:
    """The `node.drift` event of a plan, one per drift: the same repair planned again within
    FLEET_FLAP_WINDOW_S (something outside keeps undoing it) is not recorded again (None); its
    operations still are. A plan for a desired state new to the node (no `repair`) is recorded
    without looking."""
    target = f"node:{node.name}"
    if repair:
        since = timezone.now() - timedelta(seconds=settings.FLEET_FLAP_WINDOW_S)
        last = (
            AuditEvent.objects.filter(action="node.drift", target=target, created_at__gte=since)
            .values_list("after", flat=True)
            .first()
        )
        if last is not None and last.get("operations") == operations:
            return None
    return audit_event(
        actor=RECONCILER, action="node.drift", target=target, after={"operations": operations}
    )


def rollback_windows_close() -> int:
    """Let go of every baseline whose rollback window has passed; the reconcile that follows
    narrows its nodes to the release itself. Returns how many closed."""
    with transaction.atomic():
        closing = list(
            Deployment.objects.filter(baseline_until__lt=Now())
            .select_related("model", "pool", "node")
            .select_for_update(of=("self",))
        )
        for deployment in closing:
            kept = deployment.baseline_version
            deployment.baseline_version, deployment.baseline_until = None, None
            deployment.save(update_fields=["baseline_version", "baseline_until", "updated_at"])
            audit_record(
                actor=RECONCILER,
                action="deployment.close_window",
                target=f"{deployment.target}:{deployment.model.name}",
                before={"version": deployment.version, "baseline": kept},
                after={"version": deployment.version},
            )
    return len(closing)
