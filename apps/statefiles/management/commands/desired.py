from pathlib import Path

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.fleet.models import NodePool
from apps.statefiles.files import FilesError, dump, file_name
from apps.statefiles.services import desired_apply, plan
from apps.statefiles.state import read

ACTOR = "system:desired"


class Command(BaseCommand):
    help = (
        "Each pool's desired state as a YAML file for the team's Git repository: export writes "
        "them, diff shows what the database has otherwise, apply makes it match (a dry run "
        "unless --yes)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(dest="command", required=True)
        for name, what in [
            ("export", "write one file per pool"),
            ("diff", "what differs between the files and the database"),
            ("apply", "make the database match the files"),
        ]:
            command = commands.add_parser(name, help=what)
            command.add_argument("--dir", default="desired", help="the files' directory")
            if name == "export":
                command.add_argument("--pool", action="append", help="only this pool (repeat)")
            if name == "apply":
                command.add_argument("--commit", default="", help="the files' commit, audited")
                command.add_argument("--yes", action="store_true", help="apply, not a dry run")
                command.add_argument(
                    "--as",
                    dest="username",
                    help="apply as this person (their role; a protected pool's changes wait "
                    "for a second person); default: the system, which acts alone",
                )

    def handle(self, *args: object, command: str, **options: object) -> None:
        folder = Path(str(options["dir"]))
        if command == "export":
            pools = NodePool.objects.all()
            if options["pool"]:
                pools = pools.filter(name__in=options["pool"])  # type: ignore[misc]
            folder.mkdir(parents=True, exist_ok=True)
            for name, state in read(list(pools)).items():
                (folder / file_name(name)).write_text(dump(state))
                self.stdout.write(f"wrote {folder / file_name(name)}")
            return
        files = {str(path): path.read_text() for path in sorted(folder.glob("*.yaml"))}
        if not files:
            raise CommandError(f"no pool files (*.yaml) in {folder}")
        try:
            if command == "diff" or not options["yes"]:
                lines = plan(files).differences()
                self.stdout.write("\n".join(lines) if lines else "no differences")
                if command == "apply":
                    self.stdout.write("a dry run: --yes applies it")
                return
            applied = desired_apply(
                files=files, commit=str(options["commit"]), actor=self._actor(options)
            )
        except FilesError as exc:
            raise CommandError("\n".join(map(str, exc.problems))) from None
        except PermissionDenied as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write("\n".join(applied.changes) if applied.changes else "no differences")
        for approval in applied.waiting:
            self.stdout.write(f"approval {approval} waits for a second person")

    def _actor(self, options: dict[str, object]) -> str | User:
        if not options["username"]:
            return ACTOR
        user = User.objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user named {options['username']!r}")
        return user
