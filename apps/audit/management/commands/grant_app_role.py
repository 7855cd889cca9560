import os

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction
from psycopg import sql

from apps.audit.models import AuditEvent

TABLE = AuditEvent._meta.db_table


def grants(role: str) -> list[sql.Composed]:
    """What the application's role may do: everything but DDL on every table, and only SELECT
    and INSERT on the audit trail. The trail's partitions grant nothing: rows are reached
    through the parent. Default privileges give tables that later migrations create (as this,
    the owning, role) the same, so the grants need no repeating after an upgrade."""
    names = {"role": sql.Identifier(role), "schema": sql.Identifier(_schema())}
    statements = [
        "GRANT USAGE ON SCHEMA {schema} TO {role}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}",
        "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
        "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} "
        "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {role}",
        "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT ON SEQUENCES TO {role}",
    ]
    if _ensure_function_exists():
        statements.append("GRANT EXECUTE ON FUNCTION audit_partitions_ensure(integer) TO {role}")
    done = [sql.SQL(statement).format(**names) for statement in statements]
    revoke = sql.SQL("REVOKE ALL ON TABLE {table} FROM {role}")
    done += [revoke.format(table=sql.Identifier(name), **names) for name in _audit_tables()]
    only = sql.SQL("GRANT SELECT, INSERT ON TABLE {table} TO {role}")
    return [*done, only.format(table=sql.Identifier(TABLE), **names)]


def _schema() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        return str(cursor.fetchone()[0])


def _audit_tables() -> list[str]:
    """The trail itself, its partitions, and those archived and left detached."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace "
            "AND relkind IN ('r', 'p') AND relname LIKE %s",
            [TABLE.replace("_", r"\_") + "%"],
        )
        return [name for (name,) in cursor.fetchall()]


def _ensure_function_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regprocedure('audit_partitions_ensure(integer)') IS NOT NULL")
        return bool(cursor.fetchone()[0])


class Command(BaseCommand):
    help = (
        "Grant the application's database role what web and workers need: full DML on every "
        "table but the audit trail, where only SELECT and INSERT (PostgreSQL; run as the owner "
        "that migrates: DATABASE_AS_OWNER=true). Creates the role (LOGIN) if missing; its "
        "password comes from the environment variable --password-env names. Harmless to repeat."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--role", required=True, help="e.g. controlplane_app")
        parser.add_argument(
            "--password-env", default="", help="environment variable holding its password"
        )

    def handle(self, *args: object, role: str, password_env: str, **options: object) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("roles are PostgreSQL's: SQLite has one user, the file's owner")
        password = os.environ.get(password_env, "") if password_env else ""
        if password_env and not password:
            raise CommandError(f"--password-env {password_env}: that variable is empty or unset")
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT rolname = current_user FROM pg_roles WHERE rolname = %s", [role])
            found = cursor.fetchone()
            if found and found[0]:
                raise CommandError(f"{role} is the role running this: the owner, not the app's")
            if not found:
                cursor.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            if password:
                cursor.execute(
                    sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                        sql.Identifier(role), sql.Literal(password)
                    )
                )
            for statement in grants(role):
                cursor.execute(statement.as_string(connection.connection))
        self.stdout.write(
            f"{role}: SELECT, INSERT, UPDATE, DELETE on every table; SELECT, INSERT only on {TABLE}"
        )
