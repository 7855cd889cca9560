"""A pin that holds owns its pool's release of its model (fleet.PoolOwner) until it lapses."""

from django.db import migrations
from django.utils import timezone


def claim(apps, schema_editor):  # type: ignore[no-untyped-def]
    Tiers = apps.get_model("degradation", "Tiers")
    PoolOwner = apps.get_model("fleet", "PoolOwner")
    now = timezone.now()
    held = Tiers.objects.filter(pinned__isnull=False, pinned_until__gt=now)
    for tiers in held.select_related("pool", "model"):
        PoolOwner.objects.get_or_create(
            pool=tiers.pool,
            model=tiers.model,
            defaults={
                "kind": "pin",
                "ref": "pin",
                "why": f"{tiers.model.name} on {tiers.pool.name} is pinned to tier "
                f"{tiers.pinned} by {tiers.pinned_by} until {tiers.pinned_until:%Y-%m-%d %H:%M} "
                "UTC: unpin it before changing the release by hand",
                "by": tiers.pinned_by,
                "since": now,
                "until": tiers.pinned_until,
            },
        )


class Migration(migrations.Migration):
    dependencies = [
        ("degradation", "0002_probes"),
        ("fleet", "0022_pool_owner"),
    ]

    operations = [migrations.RunPython(claim, migrations.RunPython.noop)]
