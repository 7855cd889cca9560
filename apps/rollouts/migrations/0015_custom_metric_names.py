"""The analysis's own metrics were recorded as "quality: <name>", whatever they measured (a
pipeline's requests a node is not a quality); they are "custom: <name>" now."""

from django.db import migrations
from django.db.models import Value
from django.db.models.functions import Concat, Substr


def renamed(old: str, new: str):  # type: ignore[no-untyped-def]
    def rename(apps, schema_editor):  # type: ignore[no-untyped-def]
        Measurement = apps.get_model("rollouts", "Measurement")
        Measurement.objects.filter(metric__startswith=old).update(
            metric=Concat(Value(new), Substr("metric", len(old) + 1))
        )

    return rename


class Migration(migrations.Migration):
    dependencies = [("rollouts", "0014_notification_of_a_pool")]

    operations = [
        migrations.RunPython(renamed("quality: ", "custom: "), renamed("custom: ", "quality: "))
    ]
