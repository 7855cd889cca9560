from datetime import timedelta

from django.db import migrations, models
from django.utils import timezone


def expire_existing(apps, schema_editor):  # type: ignore[no-untyped-def]
    """Tokens made before expiry existed get the longest life a new one may have, from now."""
    ApiToken = apps.get_model("accounts", "ApiToken")
    ApiToken.objects.update(expires_at=timezone.now() + timedelta(days=90))


class Migration(migrations.Migration):
    dependencies = [("accounts", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.RunPython(expire_existing, migrations.RunPython.noop),
        migrations.AddField(
            model_name="apitoken",
            name="scope",
            field=models.CharField(
                choices=[("read", "read only"), ("write", "read and write (as your role allows)")],
                default="write",
                max_length=5,
            ),
        ),
    ]
