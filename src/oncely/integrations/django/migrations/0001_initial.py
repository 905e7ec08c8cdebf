"""Creates oncely's inbox tables on the database being migrated, through oncely's store (so
its schema, indexes and version rows are exactly the store's, on PostgreSQL, MariaDB/MySQL and
SQLite), and records the unmanaged :class:`~oncely.integrations.django.models.InboxRecord`
in Django's state. Not atomic: the store runs its own DDL on its own connection (PostgreSQL
builds an index concurrently when it upgrades a table). Reversing drops the tables."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.db import migrations, models

from oncely.integrations.django.databases import get_store, inbox_table
from oncely.integrations.django.models import _Text


def create_tables(apps: Any, schema_editor: Any) -> None:
    get_store(schema_editor.connection.alias).migrate()


def drop_tables(apps: Any, schema_editor: Any) -> None:
    quote = schema_editor.quote_name
    schema = ""
    if schema_editor.connection.vendor == "postgresql":
        schema = quote(getattr(settings, "ONCELY_INBOX", {}).get("schema", "public")) + "."
    for name in (inbox_table(), f"{inbox_table()}_meta", f"{inbox_table()}_offsets"):
        schema_editor.execute(f"DROP TABLE IF EXISTS {schema}{quote(name)}")


class Migration(migrations.Migration):  # type: ignore[misc] # Django ships no type information
    atomic = False
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []

    operations: ClassVar[list[Any]] = [
        migrations.RunPython(create_tables, drop_tables),
        migrations.CreateModel(
            name="InboxRecord",
            fields=[
                ("pk", models.CompositePrimaryKey("consumer", "key", serialize=False)),
                ("consumer", _Text()),
                ("key", _Text()),
                ("status", _Text()),
                ("fingerprint", _Text(null=True)),
                ("token", _Text()),
                ("attempt", models.IntegerField()),
                ("created_ms", models.BigIntegerField()),
                ("updated_ms", models.BigIntegerField()),
                ("lease_until_ms", models.BigIntegerField()),
                ("expires_ms", models.BigIntegerField()),
                ("result", models.BinaryField(null=True)),
                ("error", models.TextField(null=True)),
                ("purge_ms", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "inbox record",
                "db_table": inbox_table(),
                "managed": False,
            },
        ),
    ]
