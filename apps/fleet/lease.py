"""One worker's hold on a node while it runs the node's operations (apps/fleet/runner.py)."""

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Now
from django.utils import timezone

from apps.audit.services import Statement
from apps.fleet.models import Node
from apps.web.prepared import prepared_cursor

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
        self.claimed = False  # the first operation, claimed with the lease (`hold`)
        self.let_go = False  # with the run's last statement (`let_go_when_idle`)
        self._stop = threading.Event()

    def _take(self, then: Statement | None = None) -> tuple[bool, bool]:
        """The lease, if the node is free: no lease, or a lapsed one whose worker can no longer
        be waiting on a load it sent (_TAKE); and `then` run if it was taken, in the same
        statement on PostgreSQL. Returns whether each changed a row."""
        running_s = settings.FLEET_LOAD_TIMEOUT_S + settings.TRITON_TIMEOUT_S
        if connection.vendor != "postgresql":
            return self._take_on_one_host(then, running_s)
        params = (self.owner, self.seconds, self.node_id, running_s)
        if then is None:
            with prepared_cursor() as cursor:
                cursor.execute(_TAKE, params)
                return cursor.rowcount == 1, False
        # Written out of the callers' own statements; every value a parameter.
        statement = (
            f"WITH taken AS ({_TAKE} RETURNING 1), "  # noqa: S608
            f"followed AS ({then[0]} AND EXISTS (SELECT 1 FROM taken) RETURNING 1) "
            "SELECT (SELECT count(*) FROM taken), (SELECT count(*) FROM followed)"
        )
        with prepared_cursor() as cursor:
            cursor.execute(statement, (*params, *then[1]))
            taken, followed = cursor.fetchone()
        return taken == 1, followed == 1

    def _take_on_one_host(self, then: Statement | None, running_s: float) -> tuple[bool, bool]:
        """`_take` on SQLite, a file on one host, whose clock is that host's."""
        now = timezone.now()
        at = connection.ops.adapt_datetimefield_value
        until, may_run = now + timedelta(seconds=self.seconds), now - timedelta(seconds=running_s)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                _TAKE_ON_ONE_HOST, (self.owner, at(until), self.node_id, at(now), at(may_run))
            )
            if cursor.rowcount != 1 or then is None:
                return cursor.rowcount == 1, False
            cursor.execute(*then)
            return True, cursor.rowcount == 1

    def let_go_when_idle(self) -> Statement:
        """The lease given back if no operation is queued for the node: run with the end of a
        run's last operation (the caller sets `let_go` if it changed a row), it saves the
        run's look for more work and its release, two statements a node of a release."""
        return _LET_GO_WHEN_IDLE, (self.node_id, self.owner)

    def _renew(self) -> bool:
        until = Now() + timedelta(seconds=self.seconds)
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
    def hold(self, claim: Statement | None = None) -> Iterator["Lease"]:
        """The lease held while the block runs; `claim` (the first operation's) run with its
        take, where nothing need come between them (`claimed` says if it changed a row)."""
        self.held, self.claimed = self._take(claim)
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
            if not self.let_go:
                with prepared_cursor() as cursor:
                    cursor.execute(_LET_GO, (self.node_id, self.owner))
            self.held = False


# A lapsed lease does not prove its worker dead: one cut off from the database (or stalled) may
# still be waiting on a load it sent. Until that load can no longer be answered (an operation
# marked running, started less than a load's timeout ago, plus a connect's for the reads before
# it), the node is busy: the next owner would send a second load beside it. Written out once:
# built by the ORM, its subquery was compiled afresh for every node of a release. The statuses
# are written in, not parameters: so the open operations' index serves the prepared statement.
# The moments are the database's (apps/web/clock.py): the lease is judged by other hosts.
_TAKE = """
UPDATE fleet_node
SET lease_owner = %s, lease_until = statement_timestamp() + make_interval(secs => %s)
WHERE id = %s AND (lease_until IS NULL OR lease_until < statement_timestamp()) AND NOT EXISTS (
    SELECT 1 FROM fleet_operation
    WHERE fleet_operation.node_id = fleet_node.id AND status = 'running'
    AND started_at > statement_timestamp() - make_interval(secs => %s)
)
"""
_TAKE_ON_ONE_HOST = """
UPDATE fleet_node SET lease_owner = %s, lease_until = %s
WHERE id = %s AND (lease_until IS NULL OR lease_until < %s) AND NOT EXISTS (
    SELECT 1 FROM fleet_operation
    WHERE fleet_operation.node_id = fleet_node.id AND status = 'running' AND started_at > %s
)
"""
_LET_GO = (
    "UPDATE fleet_node SET lease_owner = '', lease_until = NULL WHERE id = %s AND lease_owner = %s"
)
_LET_GO_WHEN_IDLE = f"""{_LET_GO}
AND NOT EXISTS (
    SELECT 1 FROM fleet_operation
    WHERE fleet_operation.node_id = fleet_node.id AND status = 'queued'
)
"""  # noqa: S608 (no value in the text: both parts written out here)
