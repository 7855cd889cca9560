import json

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.rollouts.plans import PlanError
from apps.rollouts.services import RolloutError, template_save


class Command(BaseCommand):
    help = (
        "Save an analysis template (its next version): FIELD=VALUE pairs of the analysis, "
        "for one model or pool or any. Rollouts pick it by name when they start."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("fields", nargs="*", metavar="FIELD=VALUE")
        parser.add_argument("--model", default="")
        parser.add_argument("--pool", default="")

    def handle(self, *args: object, name: str, fields: list[str], **options: str) -> None:
        analysis = {}
        for item in fields:
            field, sign, value = item.partition("=")
            if not sign:
                raise CommandError(f"{item!r}: expected FIELD=VALUE, e.g. judge=statistical")
            try:
                analysis[field] = json.loads(value)
            except json.JSONDecodeError:
                analysis[field] = value  # a word: judge=statistical
        try:
            template = template_save(
                name=name,
                analysis=analysis,
                model_name=options["model"],
                pool_name=options["pool"],
                actor="system:analysis_template",
            )
        except (RolloutError, PlanError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{template}: {json.dumps(template.analysis)}")
