"""A cursor whose statements PostgreSQL prepares once per connection, for the few written-out
statements a release runs for every load of every node (the lease's, an operation's end and
claim). Django binds parameters on the client and never prepares (it keeps connection poolers
working): such a statement was parsed and planned afresh each time, a third of PostgreSQL's CPU
for a release, and quoted into text by the worker first. Only these are prepared; a pooler in
transaction mode must pass protocol-level prepared statements (deploy/README.md)."""

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from django.db import connection
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper


class _Prepared(psycopg.Cursor[Any]):
    """Asks for each statement to be prepared. psycopg prepares nothing while the connection's
    threshold is None (Django's default), not even what is asked for by name: it is set for
    this statement only. Set for good, it would have psycopg count every statement of Django's
    own (bound on the client, never prepared), keeping the whole text of the last hundred."""

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> "_Prepared":
        before = self.connection.prepare_threshold
        self.connection.prepare_threshold = _BY_NAME_ONLY if before is None else before
        try:
            return super().execute(query, params, prepare=True, binary=binary)
        finally:
            self.connection.prepare_threshold = before


_BY_NAME_ONLY = 2**31  # a count no statement reaches: only those asked for are prepared


class _Logged(CursorDebugWrapper):
    """Logs a prepared statement as the text Django would have sent for it, as it logs its own
    (psycopg keeps no text of a prepared one to read back)."""

    def debug_sql(
        self,
        sql: Any = None,
        params: Any = None,
        use_last_executed_query: bool = False,
        many: bool = False,
    ) -> AbstractContextManager[None]:
        return super().debug_sql(self.db.ops.compose_sql(sql, params), None, False, many)


@contextmanager
def prepared_cursor() -> Iterator[CursorWrapper]:
    """`connection.cursor()`, its statements prepared on PostgreSQL (a plain one elsewhere);
    what it runs is counted and logged as Django's own statements are."""
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            yield cursor
        return
    connection.ensure_connection()
    connection.validate_thread_sharing()
    wrapper = _Logged if connection.queries_logged else CursorWrapper
    with wrapper(_Prepared(connection.connection), connection) as cursor:
        yield cursor
