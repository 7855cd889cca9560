"""A rollout's gates ran the newest version of its evaluation set by name, whenever they ran; a
rollout pins the versions when it starts now. One under way is pinned to the newest there is."""

from django.db import migrations, models

ACTIVE = ["pending", "progressing", "paused", "promoting", "aborting"]


def pin_newest(apps, schema_editor):  # type: ignore[no-untyped-def]
    Rollout = apps.get_model("rollouts", "Rollout")
    EvaluationSet = apps.get_model("quality", "EvaluationSet")
    for rollout in Rollout.objects.filter(state__in=ACTIVE):
        name = rollout.analysis.get("quality_set")
        if not name:
            continue
        newest = EvaluationSet.objects.filter(name=name).order_by("model_id", "version")
        rollout.quality_sets = {s.model.name: s.pk for s in newest.select_related("model")}
        rollout.save(update_fields=["quality_sets"])


class Migration(migrations.Migration):
    dependencies = [
        ("quality", "0002_synthetic_load"),
        ("rollouts", "0015_custom_metric_names"),
    ]

    operations = [
        migrations.AddField(
            model_name="rollout",
            name="quality_sets",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text='the evaluation sets its gates run, pinned when it started: {"model": '
                "set id}",
            ),
        ),
        migrations.RunPython(pin_newest, migrations.RunPython.noop),
    ]
