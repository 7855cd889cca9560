"""A rollout under way owns its pool's release of each model it releases (fleet.PoolOwner)."""

from django.db import migrations
from django.utils import timezone

ACTIVE = ["pending", "progressing", "paused", "promoting", "aborting"]


def claim(apps, schema_editor):  # type: ignore[no-untyped-def]
    Rollout = apps.get_model("rollouts", "Rollout")
    Model = apps.get_model("registry", "Model")
    PoolOwner = apps.get_model("fleet", "PoolOwner")
    for rollout in Rollout.objects.filter(state__in=ACTIVE).select_related("model", "pool"):
        names = [rollout.model.name, *(m["model"] for m in rollout.lockstep)]
        for model in Model.objects.filter(name__in=names):
            PoolOwner.objects.get_or_create(
                pool=rollout.pool,
                model=model,
                defaults={
                    "kind": "rollout",
                    "ref": f"rollout:{rollout.pk}",
                    "why": f"rollout #{rollout.pk} on {rollout.pool.name} releases {model.name}: "
                    "abort it, or roll the pool back, before changing the release by hand",
                    "by": rollout.started_by,
                    "since": timezone.now(),
                },
            )


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0022_pool_owner"),
        ("rollouts", "0016_quality_sets_pinned"),
    ]

    operations = [migrations.RunPython(claim, migrations.RunPython.noop)]
