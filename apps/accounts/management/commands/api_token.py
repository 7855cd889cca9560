from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.accounts.models import ApiToken
from apps.accounts.services import TokenError, token_create, token_revoke

ACTOR = "system:api_token"


class Command(BaseCommand):
    help = "Create, list or revoke a user's API tokens. A new token is printed once, never again."

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(dest="command", required=True)
        create = commands.add_parser("create", help="create a token and print it")
        create.add_argument("username")
        create.add_argument("name", help="what will use it, e.g. 'release pipeline'")
        create.add_argument(
            "--days", type=int, help="lifetime (default and most: API_TOKEN_MAX_DAYS)"
        )
        scope = create.add_mutually_exclusive_group()
        scope.add_argument(
            "--scope",
            choices=ApiToken.Scope.values,
            default=ApiToken.Scope.WRITE,
            help="read, write (as the user's role allows; the default), or alerts: "
            "Alertmanager's webhook (POST /api/alertmanager) and nothing else",
        )
        scope.add_argument(
            "--read-only",
            action="store_const",
            const=ApiToken.Scope.READ,
            dest="scope",
            help="a token that changes nothing (--scope read)",
        )
        listing = commands.add_parser("list", help="a user's tokens (never their values)")
        listing.add_argument("username")
        revoke = commands.add_parser("revoke", help="revoke a token by its id")
        revoke.add_argument("token_id", type=int)

    def handle(self, *args: object, command: str, **options: object) -> None:
        try:
            if command == "revoke":
                token = token_revoke(token_id=int(str(options["token_id"])), actor=ACTOR)
                self.stdout.write(f"revoked {token.pk}: {token}")
                return
            user = User.objects.filter(username=options["username"]).first()
            if user is None:
                raise CommandError(f"no user named {options['username']!r}")
            if command == "create":
                record, value = token_create(
                    user=user,
                    name=str(options["name"]),
                    actor=ACTOR,
                    days=options["days"],  # type: ignore[arg-type]
                    scope=str(options["scope"]),
                )
                self.stdout.write(f"token {record.pk} for {user.username}: {value}")
                return
            for token in ApiToken.objects.filter(user=user):
                state = f"revoked {token.revoked_at:%Y-%m-%d}" if token.revoked_at else "active"
                expires = f"expires {token.expires_at:%Y-%m-%d}"
                self.stdout.write(f"{token.pk}\t{token}\t{token.scope}\t{state}\t{expires}")
        except TokenError as exc:
            raise CommandError(str(exc)) from exc
