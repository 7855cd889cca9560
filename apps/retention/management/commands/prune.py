from django.core.management.base import BaseCommand

from apps.retention.services import retention_prune


class Command(BaseCommand):
    help = (
        "Delete what outlived RETENTION_DAYS (finished operations, measurements of finished "
        "rollouts, sent notifications, settled approvals, sign-in records) and expired "
        "sessions, in batches; make the audit trail's coming monthly partitions. Beat runs it "
        "hourly; this runs it now, to the end."
    )

    def handle(self, *args: object, **options: object) -> None:
        counts = retention_prune(actor="system:prune")
        self.stdout.write(", ".join(f"{kind} {count}" for kind, count in counts.items()))
