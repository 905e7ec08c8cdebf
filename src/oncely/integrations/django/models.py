"""The inbox's records as a read-only Django model, for queries and reports::

    from oncely.integrations.django.models import InboxRecord

    InboxRecord.objects.filter(consumer="billing", status="failed").count()

The table is oncely's own (created by the app's migration through the store, so the store's
schema is the only one): the model is unmanaged, and rows are written by oncely only. Times
are milliseconds since the epoch (``created_ms``, ``expires_ms``, ...), as the store keeps
them; ``result`` holds the stored result's encoded bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import models

from oncely.integrations.django.databases import inbox_table
from oncely.stores._compact import unpack_fingerprint, unpack_token

_UNPACK: dict[str, Callable[[Any], str | None]] = {
    "token": unpack_token,
    "fingerprint": unpack_fingerprint,
}
"""The columns SQLite and MariaDB/MySQL keep in a compact form (:mod:`oncely.stores._compact`)."""


class _Text(models.TextField):  # type: ignore[misc] # Django ships no type information
    """Text that MariaDB/MySQL keep as ``VARBINARY`` (the key and consumer compare byte for
    byte), and the token and fingerprint that SQLite and MariaDB/MySQL keep as bytes: read
    back as ``str`` on every database."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        unpack = _UNPACK.get(self.name)
        if unpack is not None and value is not None:
            return unpack(bytes(value) if isinstance(value, bytearray | memoryview) else value)
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value).decode("utf-8", "replace")
        return value


class InboxRecord(models.Model):  # type: ignore[misc] # Django ships no type information
    """One record of oncely's inbox: a consumer's claim of a key and how it ended."""

    pk = models.CompositePrimaryKey("consumer", "key")
    consumer = _Text()
    key = _Text()
    status = _Text()  # in_progress | completed | failed
    fingerprint = _Text(null=True)
    token = _Text()
    attempt = models.IntegerField()
    created_ms = models.BigIntegerField()
    updated_ms = models.BigIntegerField()
    lease_until_ms = models.BigIntegerField()
    expires_ms = models.BigIntegerField()
    result = models.BinaryField(null=True)
    error = models.TextField(null=True)
    purge_ms = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = inbox_table()
        app_label = "oncely"
        verbose_name = "inbox record"

    def __str__(self) -> str:
        return f"{self.consumer}/{self.key}: {self.status}"
