"""On PostgreSQL the audit trail becomes a table partitioned by month (PARTITION BY RANGE
(created_at)): kept forever, an old month can still be archived and detached whole
(`manage.py audit_archive`) instead of deleted row by row, which the trigger forbids anyway.

The table is rebuilt once, under an exclusive lock: rows, indexes, the user foreign key, the
append-only trigger and the grants move to the new table. PostgreSQL wants the partition key in
the primary key, so the table's is (id, created_at); Django keeps `id` as the model's pk, unique
all the same, from the one sequence. A partition per month of the existing events and the next
months, and a DEFAULT partition, so that an insert never fails for want of one.
`audit_partitions_ensure(months)` creates the coming months' partitions; it runs as the owner
(SECURITY DEFINER), so the application's role, which owns nothing, may call it
(apps/audit/partitions.py, from the retention task). On SQLite nothing changes.

Unapplying leaves the table partitioned: it serves the same model, and applying again finds it
so."""

from datetime import UTC, date, datetime

from django.db import migrations

TABLE = "audit_auditevent"
AHEAD = 3  # months of partitions made ahead of the current one

# Creates this month's partition and the next `months`, each unless it exists, or events of its
# month already wait in the DEFAULT partition (they stay there: moving them would be a DELETE).
# Partitions grant nothing to anyone: the application reaches rows only through the parent table.
ENSURE = """
CREATE OR REPLACE FUNCTION audit_partitions_ensure(months integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    first date := date_trunc('month', now() AT TIME ZONE 'UTC')::date;
    start date;
    stop date;
    part text;
    grantee oid;
    made integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('audit_partitions_ensure'));
    FOR i IN 0..months LOOP
        start := first + make_interval(months => i);
        stop := start + interval '1 month';
        part := format('audit_auditevent_p%s', to_char(start, 'YYYY_MM'));
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        IF EXISTS (
            SELECT 1 FROM audit_auditevent_default
            WHERE created_at >= start::timestamp AT TIME ZONE 'UTC'
              AND created_at < stop::timestamp AT TIME ZONE 'UTC'
        ) THEN
            RAISE WARNING 'audit partition % not created: its events are in the default one', part;
            CONTINUE;
        END IF;
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF audit_auditevent FOR VALUES FROM (%L) TO (%L)',
            part, start::timestamp AT TIME ZONE 'UTC', stop::timestamp AT TIME ZONE 'UTC'
        );
        -- Default privileges (grant_app_role's) must not reach past the parent.
        EXECUTE format('REVOKE ALL ON TABLE %I FROM PUBLIC', part);
        FOR grantee IN
            SELECT DISTINCT acl.grantee FROM pg_class c, aclexplode(c.relacl) acl
            WHERE c.oid = part::regclass AND acl.grantee NOT IN (0, c.relowner)
        LOOP
            EXECUTE format('REVOKE ALL ON TABLE %I FROM %I', part, pg_get_userbyid(grantee));
        END LOOP;
        made := made + 1;
    END LOOP;
    RETURN made;
END;
$$;
REVOKE ALL ON FUNCTION audit_partitions_ensure(integer) FROM PUBLIC;
"""

# The old table steps aside, its identity (and the sequence's name) with it; the new one takes
# its columns and defaults, ids from a sequence of its own (PostgreSQL 15 has no identity column
# on a partitioned table).
REBUILD = [
    "ALTER TABLE audit_auditevent RENAME TO audit_auditevent_unpartitioned",
    "ALTER TABLE audit_auditevent_unpartitioned ALTER COLUMN id DROP IDENTITY IF EXISTS",
    "CREATE SEQUENCE audit_auditevent_id_seq AS bigint",
    "CREATE TABLE audit_auditevent (LIKE audit_auditevent_unpartitioned INCLUDING DEFAULTS "
    "INCLUDING CONSTRAINTS) PARTITION BY RANGE (created_at)",
    "ALTER TABLE audit_auditevent ALTER COLUMN id SET DEFAULT nextval('audit_auditevent_id_seq')",
    "ALTER SEQUENCE audit_auditevent_id_seq OWNED BY audit_auditevent.id",
    "CREATE TABLE audit_auditevent_default PARTITION OF audit_auditevent DEFAULT",
]
# With its partitions made: the rows, the sequence past them, then the keys (built once, after
# the rows are in).
MOVE = [
    "INSERT INTO audit_auditevent SELECT * FROM audit_auditevent_unpartitioned",
    "SELECT setval('audit_auditevent_id_seq', "
    "(SELECT coalesce(max(id), 0) + 1 FROM audit_auditevent), false)",
    "DROP TABLE audit_auditevent_unpartitioned",
    "ALTER TABLE audit_auditevent ADD PRIMARY KEY (id, created_at)",
]

TRIGGER = """
CREATE TRIGGER audit_event_append_only
    BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_event_append_only()
"""


def _next(month: date) -> date:
    return date(month.year + month.month // 12, month.month % 12 + 1, 1)


def partition(apps: object, schema_editor: object) -> None:
    connection = schema_editor.connection  # type: ignore[attr-defined]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", [TABLE])
        if cursor.fetchone()[0] == "p":  # applied before, then unapplied
            cursor.execute(ENSURE)
            return
        cursor.execute("LOCK TABLE audit_auditevent IN ACCESS EXCLUSIVE MODE")
        cursor.execute(
            "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
            "WHERE indrelid = %s::regclass AND NOT indisprimary",
            [TABLE],
        )
        indexes = cursor.fetchall()
        cursor.execute(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = %s::regclass AND contype = 'f'",
            [TABLE],
        )
        foreign_keys = cursor.fetchall()
        cursor.execute(
            "SELECT pg_get_userbyid(acl.grantee), acl.privilege_type "
            "FROM pg_class c, aclexplode(c.relacl) acl "
            "WHERE c.oid = %s::regclass AND acl.grantee NOT IN (0, c.relowner)",
            [TABLE],
        )
        grants = cursor.fetchall()
        cursor.execute("SELECT min(created_at) FROM audit_auditevent")
        oldest = cursor.fetchone()[0] or datetime.now(UTC)

        for statement in REBUILD:
            cursor.execute(statement)
        start, last = oldest.date().replace(day=1), datetime.now(UTC).date().replace(day=1)
        for _ in range(AHEAD):
            last = _next(last)
        while start <= last:
            cursor.execute(
                f"CREATE TABLE audit_auditevent_p{start:%Y_%m} PARTITION OF audit_auditevent "
                f"FOR VALUES FROM ('{start} 00:00+00') TO ('{_next(start)} 00:00+00')"
            )
            cursor.execute(f"REVOKE ALL ON TABLE audit_auditevent_p{start:%Y_%m} FROM PUBLIC")
            start = _next(start)
        for statement in MOVE:
            cursor.execute(statement)
        for _, definition in indexes:
            cursor.execute(definition)
        for name, definition in foreign_keys:
            cursor.execute(f'ALTER TABLE audit_auditevent ADD CONSTRAINT "{name}" {definition}')
        cursor.execute(TRIGGER)
        for grantee, privilege in grants:
            cursor.execute(f'GRANT {privilege} ON TABLE audit_auditevent TO "{grantee}"')
            if privilege == "INSERT":
                cursor.execute(f'GRANT USAGE ON SEQUENCE audit_auditevent_id_seq TO "{grantee}"')
        cursor.execute(ENSURE)


class Migration(migrations.Migration):
    atomic = True

    dependencies = [
        ("audit", "0004_via"),
    ]

    operations = [
        migrations.RunPython(partition, migrations.RunPython.noop, elidable=False),
    ]
