from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.quality.errors import QualityError
from apps.quality.services import evaluation_set_import


class Command(BaseCommand):
    help = (
        "Import an evaluation set from JSON Lines (one case per line: name, inputs, expect) as "
        "the named set's next version for MODEL."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("name", help="the set's name, e.g. faq")
        parser.add_argument("file", type=Path)

    def handle(self, *args: object, model: str, name: str, file: Path, **options: object) -> None:
        try:
            with file.open("rb") as lines:  # read as the cases are checked, a line at a time
                found = evaluation_set_import(
                    model_name=model,
                    name=name,
                    text=lines,
                    actor="system:import_evaluation_set",
                    source=file.name,
                )
        except OSError as exc:
            raise CommandError(f"{file}: {exc}") from None
        except QualityError as exc:
            raise CommandError(
                "\n".join(f"{file}: {problem}" for problem in exc.problems)
            ) from None
        self.stdout.write(f"{found}: {found.cases.count()} cases")
