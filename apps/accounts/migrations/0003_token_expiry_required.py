from django.db import migrations, models


class Migration(migrations.Migration):
    """Apart from 0002: PostgreSQL will not alter a table with updates pending in the same
    transaction."""

    dependencies = [("accounts", "0002_token_expiry_and_scope")]

    operations = [
        migrations.AlterField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(),
        ),
    ]
