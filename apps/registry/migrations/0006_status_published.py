"""A version that may deploy is *published*, not *released*: a release is what a pool serves
(the `Release` rows), one name for one idea."""

from collections.abc import Callable

from django.db import migrations, models


def rename(old: str, new: str) -> Callable[[object, object], None]:
    def run(apps: object, schema_editor: object) -> None:
        versions = apps.get_model("registry", "ModelVersion")  # type: ignore[attr-defined]
        versions.objects.filter(status=old).update(status=new)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0005_version_memory"),
    ]

    operations = [
        migrations.AlterField(
            model_name="modelversion",
            name="status",
            field=models.CharField(
                choices=[
                    ("draft", "Draft"),
                    ("published", "Published"),
                    ("deprecated", "Deprecated"),
                ],
                default="draft",
                max_length=20,
            ),
        ),
        migrations.RunPython(rename("released", "published"), rename("published", "released")),
    ]
