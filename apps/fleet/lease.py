"""One worker's hold on a node while it runs the node's operations (apps/fleet/runner.py)."""

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from apps.fleet.models import Node, Operation
from controlplane.prepared import prepared_cursor

log = logging.getLogger(__name__)


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

    def _take(self) -> bool:
        """The lease, if the node is free: no lease, or a lapsed one whose worker can no longer
        be waiting on a load it sent (_TAKE)."""
        now = timezone.now()
        until = now + timedelta(seconds=self.seconds)
        may_run = now - timedelta(seconds=settings.FLEET_LOAD_TIMEOUT_S + settings.TRITON_TIMEOUT_S)
        at = connection.ops.adapt_datetimefield_value
        params = (
            self.owner,
            at(until),
            self.node_id,
            at(now),
            Operation.Status.RUNNING,
            at(may_run),
        )
        with prepared_cursor() as cursor:
            cursor.execute(_TAKE, params)
            return cursor.rowcount == 1

    def _renew(self) -> bool:
        until = timezone.now() + timedelta(seconds=self.seconds)
        renewed = Node.objects.filter(pk=self.node_id, lease_owner=self.owner)
        return bool(renewed.update(lease_until=until))

    def _heartbeat(self) -> None:
        try:
            while self.held and not self._stop.wait(self.seconds / 3):
                self.held = self._renew()
        except Exception:
            log.exception("node %s: lease renewal failed", self.node_id)
            self.held = False
        finally:
            connection.close()  # this thread's own connection

    @contextmanager
    def hold(self) -> Iterator["Lease"]:
        self.held = self._take()
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
            with prepared_cursor() as cursor:
                cursor.execute(_RELEASE, (self.node_id, self.owner))
            self.held = False


# A lapsed lease does not prove its worker dead: one cut off from the database (or stalled) may
# still be waiting on a load it sent. Until that load can no longer be answered (an operation
# marked running, started less than a load's timeout ago, plus a connect's for the reads before
# it), the node is busy: the next owner would send a second load beside it. Written out once:
# built by the ORM, its subquery was compiled afresh for every node of a release.
_TAKE = """
UPDATE fleet_node SET lease_owner = %s, lease_until = %s
WHERE id = %s AND (lease_until IS NULL OR lease_until < %s) AND NOT EXISTS (
    SELECT 1 FROM fleet_operation
    WHERE fleet_operation.node_id = fleet_node.id AND status = %s AND started_at > %s
)
"""
_RELEASE = (
    "UPDATE fleet_node SET lease_owner = '', lease_until = NULL WHERE id = %s AND lease_owner = %s"
)
