from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.accounts.models import PoolRole
from apps.accounts.services import RoleError
from apps.fleet.services.pools import pool_role_set


class Command(BaseCommand):
    help = (
        "Give a user a role on one pool, above their own role (which stays theirs everywhere "
        "else): operator or release_manager; none takes it away. Audited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("pool")
        parser.add_argument("role", choices=[*PoolRole.Role.values, "none"])

    def handle(self, *args: object, username: str, pool: str, role: str, **_: object) -> None:
        try:
            pool_role_set(
                username=username,
                pool_name=pool,
                role="" if role == "none" else role,
                actor="system:set_pool_role",
            )
        except RoleError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{username} on {pool}: {role}")
