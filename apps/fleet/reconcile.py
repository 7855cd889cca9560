"""Converging a node, the first half: read it, compare what it serves with its desired state,
and plan the operations that are missing (make before break: apps/fleet/planner.py). The
runner (apps/fleet/runner.py) carries them out."""

import json
import logging
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, Subquery
from django.utils import timezone

from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet import memory, quarantine
from apps.fleet.desired import Desired, DesiredStateError, node_desired, plan_digest
from apps.fleet.models import Deployment, Node, Operation
from apps.fleet.planner import Observed, plan
from apps.fleet.polling import node_poll, node_read_index
from apps.fleet.runner import RECONCILER, DesiredDigest, save_owned
from apps.fleet.selectors import converged
from apps.fleet.stages import stage_set
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.triton import ready_in
from apps.registry.models import Model

log = logging.getLogger(__name__)


def observed_state(node: Node) -> dict[str, Observed]:
    """The node's last index read, plus what our own operations last did to each model."""
    # Every model the index lists, READY in no version or in some.
    ready: dict[str, set[int]] = {entry["model"]: set() for entry in node.index}
    ready |= ready_in(node.index)
    busy = {e["model"] for e in node.index if e.get("state") in ("LOADING", "UNLOADING")}
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


# The window query of _history, written once: built with the ORM, it was compiled afresh for
# every reconcile of every node, a sixth of the CPU of a node's reconcile and run. Per model:
# each operation's place in the model's history (`position`), its rank among the model's
# operations of the same status and kind (the set of versions for an unknown, the config for a
# failure; `nth`), and among those held back or not (`nth_held`). Descending is the ascending
# order reversed on every database, NULLs included.
_HISTORY = """
SELECT model_name, status, versions, config_digest, "position", nth, held FROM (
    SELECT model_name, status, versions, config_digest, held,
        ROW_NUMBER() OVER (
            PARTITION BY model_name ORDER BY finished_at ASC, id ASC
        ) AS "position",
        ROW_NUMBER() OVER (
            PARTITION BY model_name, status, CASE
                WHEN status = %s THEN CAST(versions AS TEXT)
                WHEN status = %s THEN config_digest
                ELSE '' END
            ORDER BY finished_at DESC, id DESC
        ) AS nth,
        ROW_NUMBER() OVER (
            PARTITION BY model_name, held ORDER BY finished_at DESC, id DESC
        ) AS nth_held
    FROM (
        SELECT *, CASE WHEN status = %s AND (retry_at IS NULL OR retry_at > %s)
            THEN 1 ELSE 0 END AS held
        FROM fleet_operation WHERE node_id = %s AND status IN (%s, %s, %s)
    ) done
) ranked
WHERE nth = 1 OR (nth_held = 1 AND held = 1)
"""


def _history(node: Node, now: datetime) -> list[_Done]:
    """What `observed_state` needs of the node's finished operations, in one query whose rows
    do not grow with its history: per model, its last success, its last unknown for each set
    of versions asked, its last failure of each config, and its last failure still held back
    at `now`."""
    status, at = Operation.Status, connection.ops.adapt_datetimefield_value(now)
    kinds = (status.UNKNOWN, status.FAILED)
    done = (status.SUCCEEDED, status.FAILED, status.UNKNOWN)
    with connection.cursor() as cursor:
        cursor.execute(_HISTORY, (*kinds, status.FAILED, at, node.pk, *done))
        rows = cursor.fetchall()
    return [
        _Done(
            model,
            ended,
            set(json.loads(versions)),  # JSON text on both databases, as Django reads it
            digest,
            position,
            nth == 1,
            bool(held),
        )
        for model, ended, versions, digest, position, nth, held in rows
    ]


def node_reconcile(*, node_id: int, wanted: DesiredDigest | None = None) -> list[Operation]:
    """Read the node and plan what is missing. Returns what the caller runs now (node_run,
    handed `wanted`: what the plan was made from, not computed twice): the operations just
    planned, or open ones whose run was lost. Harmless to repeat: a node with queued or running
    operations is left to them, and a converged node gets no operation at all."""
    node = node_read_index(node_id=node_id)
    if node.health == Node.Health.UNREACHABLE or node.last_error:
        return []
    if node.stage == Node.Stage.DEPARTED:
        return []
    if node.stage == Node.Stage.QUARANTINED:
        if not quarantine.restarted(node):
            return []  # left alone until a person or a restart clears it
        node.refresh_from_db(fields=["stage"])  # released: joining, it is planned for now
    try:
        desired = node_desired(node)
    except DesiredStateError as exc:
        log.warning("node %s: %s", node.name, exc)
        return []
    with transaction.atomic():
        # Its pool comes along for the run this plan is handed to (`wanted`: the balancer, the
        # warm-up); only the node's row is locked.
        pending = Operation.objects.filter(node=OuterRef("pk"), status__in=Operation.OPEN)
        planned = Operation.objects.filter(node=OuterRef("pk")).exclude(plan_digest="")
        newest = Deployment.objects.filter(Q(pool_id=OuterRef("pool_id")) | Q(node=OuterRef("pk")))
        locked = (
            Node.objects.select_for_update(of=("self",))
            .select_related("pool")
            .annotate(
                pending=Exists(pending),
                # What a plan is recorded with (its request, whether it repeats a repair:
                # _record_drift), read here rather than each in a statement of its own.
                last_plan=Subquery(planned.order_by("-id").values("plan_digest")[:1]),
                newest_request=Subquery(newest.order_by("-updated_at").values("request_id")[:1]),
            )
            .get(pk=node_id)
        )
        if locked.pending:  # type: ignore[attr-defined]
            # Work is pending. If no worker has held the node for longer than a lease since it was
            # queued, its run was lost (a killed worker's unacknowledged task comes back only
            # after the visibility timeout): hand it to the caller. Younger work is about to be
            # taken; running it too would only find the node busy.
            now = timezone.now()
            stale = now - timedelta(seconds=settings.FLEET_LEASE_S)
            free = locked.lease_until is None or locked.lease_until < now
            lost = locked.operations.filter(status__in=Operation.OPEN, created_at__lt=stale)
            return list(lost) if free else []
        observed = observed_state(node)
        owned = _pruned(locked, desired, observed)
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
        actions = plan(desired, observed, managed, room)
        digest = plan_digest(desired)
        # A plan for a desired state the node was not planned for before is a change's; one
        # for the same state again, a repair's.
        changed = digest != locked.last_plan  # type: ignore[attr-defined]
        request: str | None = locked.newest_request  # type: ignore[attr-defined]
        if actions and changed and request and not REQUEST_ID.get():
            # A periodic reconcile that carries out a new desired state records it under the
            # request that changed it (the newest deployment targeting the node), as that
            # request's own reconcile would have; a repair is nobody's request.
            REQUEST_ID.set(request)  # for the rest of this node's reconcile: its events and run
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
        if wanted is not None:
            wanted.seed(locked, digest, ops)  # read under the lock: its owned models as pruned
        if ops:
            _record_drift(node, [str(op) for op in ops], repair=not changed)
    if not ops and node.stage == Node.Stage.JOINING:
        _join(node, desired, observed)
    return ops


def _join(node: Node, desired: Desired, observed: dict[str, Observed]) -> None:
    """A joining node takes traffic once its index, read just now, shows exactly what its
    desired state names READY (the run that loaded it warmed it, out of traffic), and it
    answers ready; until then its balancer weight stays 0."""
    if not all(converged(observed.get(n, _GONE).ready, m.versions) for n, m in desired.items()):
        return
    if node_poll(node_id=node.pk).health != Node.Health.READY:
        return
    now = timezone.now()
    with transaction.atomic():
        locked = Node.objects.select_for_update().select_related("pool").get(pk=node.pk)
        if locked.stage != Node.Stage.JOINING:
            return
        if locked.operations.filter(status__in=Operation.OPEN).exists():
            return
        took = (now - (locked.stage_changed_at or now)).total_seconds()
        serving = {name: sorted(model.versions) for name, model in desired.items()}
        stage_set(
            locked,
            Node.Stage.SERVING,
            actor=RECONCILER,
            action="node.join",
            message=f"takes traffic {took:.1f} s after it joined: its pool's release read "
            "back READY, warmed, ready",
            at=now,
            after={"serving": serving, "joining_s": round(took, 1)},
        )
        if locked.pool.traffic:
            transaction.on_commit(lambda: traffic_sync(locked.pool_id), robust=True)


def _pruned(node: Node, desired: Desired, observed: dict[str, Observed]) -> set[str]:
    """The node's owned models, less those no deployment names and that are gone from it: they
    are drained, and if someone loads one of them again it is theirs. Call under the row lock."""
    owned = {
        name for name in node.owned if name in desired or observed.get(name, _GONE).ready
    } | set(desired)
    save_owned(node, owned)
    return owned


_GONE = Observed(frozenset())


def _record_drift(node: Node, operations: list[str], *, repair: bool = True) -> None:
    """One `node.drift` event per drift: the same repair planned again within FLEET_FLAP_WINDOW_S
    (something outside keeps undoing it) is not recorded again; its operations still are. A
    plan for a desired state new to the node (no `repair`) is recorded without looking."""
    target = f"node:{node.name}"
    if repair:
        since = timezone.now() - timedelta(seconds=settings.FLEET_FLAP_WINDOW_S)
        last = (
            AuditEvent.objects.filter(action="node.drift", target=target, created_at__gte=since)
            .values_list("after", flat=True)
            .first()
        )
        if last is not None and last.get("operations") == operations:
            return
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
                action="deployment.close_window",
                target=f"{deployment.target}:{deployment.model.name}",
                before={"version": deployment.version, "baseline": kept},
                after={"version": deployment.version},
            )
    return len(closing)
