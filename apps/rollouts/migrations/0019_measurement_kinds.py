from django.db import migrations, models
from django.db.models import Q

# What each measurement measured, from the names its rounds gave it (a lockstep member's carry
# the member's name first); a custom metric's name may be anything, so it goes first.
KINDS = [
    ("custom", Q(metric__startswith="custom: ")),
    ("prometheus", Q(metric="prometheus")),
    ("quality", Q(metric__startswith="quality")),
    ("requests", Q(metric="requests") | Q(metric__endswith=": requests")),
    ("latency", Q(metric__regex=r"(^|: )(p99|latency \(samples\))$")),
    ("errors", Q(metric__regex=r"(^|: )error_ratio( \(samples\))?$")),
    ("step", Q(metric__regex=r"(^|: )mean latency ")),
    ("burn", Q(metric__endswith=" burn rate")),
]


def kinds_from_names(apps: object, schema_editor: object) -> None:
    measurement = apps.get_model("rollouts", "Measurement")  # type: ignore[attr-defined]
    for kind, named in KINDS:
        measurement.objects.filter(named, kind="").update(kind=kind)
    # A name none of these knows is shown under its own name, as a custom metric's is.
    measurement.objects.filter(kind="").update(kind="custom")


class Migration(migrations.Migration):
    dependencies = [
        ("rollouts", "0018_rounds"),
    ]

    operations = [
        migrations.AddField(
            model_name="measurement",
            name="kind",
            field=models.CharField(
                choices=[
                    ("requests", "Requests"),
                    ("latency", "Latency"),
                    ("errors", "Errors"),
                    ("step", "Step"),
                    ("burn", "Burn"),
                    ("ttft", "Ttft"),
                    ("itl", "Itl"),
                    ("tokens", "Tokens"),
                    ("custom", "Custom"),
                    ("quality", "Quality"),
                    ("prometheus", "Prometheus"),
                ],
                default="",
                help_text="what it measures",
                max_length=12,
            ),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="measurement",
            name="metric",
            field=models.CharField(help_text="its name, as people read it", max_length=120),
        ),
        migrations.RunPython(kinds_from_names, migrations.RunPython.noop),
    ]
