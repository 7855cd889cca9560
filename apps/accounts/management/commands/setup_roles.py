from django.core.management.base import BaseCommand, CommandParser

from apps.accounts.roles import ROLE_ORDER
from apps.accounts.services import roles_sync, user_ensure

DEMO_PASSWORD = "triton-demo"  # noqa: S105 - local demo only, printed for the newcomer


class Command(BaseCommand):
    help = "Create the viewer, operator, release_manager and admin groups (idempotent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--demo-users", action="store_true", help="also create one demo user per role"
        )

    def handle(self, *args: object, demo_users: bool, **options: object) -> None:
        for group in roles_sync():
            self.stdout.write(f"role {group.name}: {group.permissions.count()} permissions")
        if demo_users:
            for role in ROLE_ORDER:
                user_ensure(username=role.value, password=DEMO_PASSWORD, role=role)
                self.stdout.write(f"demo login: {role.value} / {DEMO_PASSWORD}")
