"""One clock for what one host writes and another reads: the database's. A lease, an owner's
term, a pin, a rollback window and an approval's expiry are each set by one process and judged
by others, on other hosts; a host whose own clock ran ahead would take a lease still held, or
keep an approval alive past its time. On PostgreSQL each such moment is the database's:
`database_now()` in Python, Django's `Now()` in a query (STATEMENT_TIMESTAMP(), the same), and
`statement_timestamp()` in a written-out statement. SQLite is a file on one host: its clock is
that host's."""

from datetime import datetime

from django.db import connection
from django.utils import timezone


def database_now() -> datetime:
    """Now, by the database's clock (one query on PostgreSQL)."""
    if connection.vendor != "postgresql":
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]
