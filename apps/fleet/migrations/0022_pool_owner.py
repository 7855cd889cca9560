import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0021_discovery_held"),
        ("registry", "0006_status_published"),
    ]

    operations = [
        migrations.CreateModel(
            name="PoolOwner",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[("rollout", "Rollout"), ("pin", "Pin")], max_length=10
                    ),
                ),
                (
                    "ref",
                    models.CharField(help_text='which one: "rollout:12", "pin"', max_length=60),
                ),
                ("why", models.TextField(help_text="what a person told to wait reads")),
                ("by", models.CharField(max_length=150)),
                ("since", models.DateTimeField()),
                ("until", models.DateTimeField(blank=True, help_text="a pin's end", null=True)),
                (
                    "model",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="owners",
                        to="registry.model",
                    ),
                ),
                (
                    "pool",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="owners",
                        to="fleet.nodepool",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("pool", "model"), name="one_owner_per_pool_and_model"
                    )
                ],
            },
        ),
    ]
