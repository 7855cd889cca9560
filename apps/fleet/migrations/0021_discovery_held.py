from django.db import migrations, models


def open_found_pools(apps, schema_editor):  # type: ignore[no-untyped-def]
    """Pools discovery already fills keep taking its nodes, unless protected: a protected pool
    takes discovered nodes again once a second person approves it."""
    NodePool = apps.get_model("fleet", "NodePool")
    found = NodePool.objects.filter(nodes__discovered_at__isnull=False, protected=False)
    NodePool.objects.filter(pk__in=found.values("pk")).update(discoverable=True)


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0020_operation_node_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="unlisted_since",
            field=models.DateTimeField(
                blank=True,
                help_text="the first discovery pass since then that did not list the node's target",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="nodepool",
            name="discoverable",
            field=models.BooleanField(
                default=False,
                help_text="nodes that discovery finds labelled with this pool join it by "
                "themselves (turned on for a protected pool only with a second person's approval)",
            ),
        ),
        migrations.RunPython(open_found_pools, migrations.RunPython.noop),
    ]
