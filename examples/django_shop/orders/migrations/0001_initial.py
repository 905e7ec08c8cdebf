# ruff: noqa: RUF012 - a Django migration, as makemigrations writes it
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = [("oncely", "0001_initial")]
    operations = [
        migrations.CreateModel(
            name="Charge",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("order", models.CharField(max_length=64)),
                ("amount", models.IntegerField()),
            ],
        ),
    ]
