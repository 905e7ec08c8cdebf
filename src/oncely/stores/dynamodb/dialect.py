"""The table's layout: one item per ``(consumer, key)``, its attributes, and the conditions of
the store's writes, in DynamoDB's expression language.

An item holds:

=========  ====  ===========================================================================
attribute  type  what
=========  ====  ===========================================================================
``pk``     S     the partition key: ``<characters in consumer>:<consumer>:<key>``
                 (unambiguous whatever the two hold; the table has no sort key, so the
                 records of one consumer spread over every partition)
``c``      S     the consumer
``k``      S     the key
``st``     S     the status (``in_progress``, ``completed``, ``failed``)
``fp``     S     the payload's fingerprint (absent when unknown)
``tok``    S     the fencing token of the claim that owns the record
``att``    N     the attempt
``cr``     N     created, epoch milliseconds of the store's clock
``up``     N     updated
``lu``     N     the lease's end
``ex``     N     the expiry (every read treats ``ex <= now`` as no record)
``ttl_s``  N     the expiry in epoch seconds, rounded up: DynamoDB's TTL attribute
``res``    B     the result (absent when none)
``err``    S     the error of a failed record, the note of a completed one (absent when none)
``rev``    S     a random revision, new at every write: a write decided from a record read
                 before applies only while the item is still that revision
=========  ====  ===========================================================================

The schema marker is an item of its own, ``pk = "#schema"``, which no record's key can be
(a record's starts with a digit).
"""

from __future__ import annotations

import os
from typing import Any, Final

from oncely._core.records import Record, Status, new_record
from oncely.errors import ConfigurationError, InvalidKey, KeyTooLong

__all__ = [
    "ABSENT",
    "MARKER",
    "MAX_PARTITION_KEY_BYTES",
    "OFFSETS",
    "SCHEMA_VERSION",
    "Item",
    "from_item",
    "new_rev",
    "offsets_key",
    "offsets_of",
    "partition_key",
    "to_item",
]

Item = dict[str, Any]
"""An item in DynamoDB's typed JSON (``{"S": ...}``, ``{"N": "..."}``, ``{"B": ...}``)."""

SCHEMA_VERSION: Final = 1
MARKER: Final = "#schema"
"""The partition key of the schema marker item."""
OFFSETS: Final = "#offsets:"
"""The start of the partition key of a stored offsets item."""
MAX_PARTITION_KEY_BYTES: Final = 2048
"""DynamoDB's limit on a partition key value (UTF-8 bytes)."""

ABSENT: Final = "attribute_not_exists(pk) OR ex <= :now"
"""The condition of a write decided on no record: there is none, or it expired."""

_STATUS: Final = {s.value: s for s in Status}


def new_rev() -> str:
    """A revision no other write will have."""
    return os.urandom(9).hex()


def partition_key(consumer: str, key: str) -> str:
    """The item's partition key; :class:`~oncely.KeyTooLong` (naming ``hash_long_keys``) when
    it is over DynamoDB's 2,048 bytes: never cut, as two keys would then share a record."""
    pk = f"{len(consumer)}:{consumer}:{key}"
    try:
        size = len(pk.encode())
    except UnicodeEncodeError:
        raise InvalidKey(
            "a dedup key and consumer must be valid Unicode text; this one holds a lone surrogate"
        ) from None
    if size > MAX_PARTITION_KEY_BYTES:
        raise KeyTooLong(
            f"the consumer and key take {size} bytes in the DynamoDB partition key, over its "
            f"limit of {MAX_PARTITION_KEY_BYTES}: lower Limits.max_key_bytes or set "
            "hash_long_keys=True (oncely consume --hash-long-keys)"
        )
    return pk


def _n(value: int) -> dict[str, str]:
    return {"N": str(value)}


def ttl_seconds(expires_ms: int) -> int:
    """The TTL attribute's value: the expiry in epoch seconds, rounded up (DynamoDB never
    deletes an item before it expired)."""
    return -(-expires_ms // 1000)


def offsets_key(consumer: str, stream: str, part: int | None = None) -> str:
    """The partition key of the item keeping ``consumer``'s next offset of ``stream``'s
    partition ``part`` (its attribute ``p<part>``), or with ``part`` None of the item listing
    the partitions kept (its number set ``ps``); never a record's, whose key starts with a
    digit. One item per partition: partitions consumed side by side write apart."""
    pk = f"{OFFSETS}{len(consumer)}:{consumer}:{len(stream)}:{stream}"
    if part is not None:
        pk += f":{part}"
    size = len(pk.encode())
    if size > MAX_PARTITION_KEY_BYTES:
        raise ConfigurationError(
            f"the consumer and stream take {size} bytes in the DynamoDB partition key of "
            f"their stored offsets, over its {MAX_PARTITION_KEY_BYTES}: use a shorter consumer"
        )
    return pk


def offsets_of(item: Item | None) -> dict[int, int]:
    """The partitions' next offsets an offsets item keeps."""
    if not item:
        return {}
    return {
        int(name[1:]): int(value["N"])
        for name, value in item.items()
        if name[:1] == "p" and name[1:].isdigit() and "N" in value
    }


def to_item(pk: str, rec: Record, rev: str) -> Item:
    """The whole item of ``rec``."""
    item: Item = {
        "pk": {"S": pk},
        "c": {"S": rec.consumer},
        "k": {"S": rec.key},
        "st": {"S": rec.status.value},
        "tok": {"S": rec.token},
        "att": _n(rec.attempt),
        "cr": _n(rec.created_ms),
        "up": _n(rec.updated_ms),
        "lu": _n(rec.lease_until_ms),
        "ex": _n(rec.expires_ms),
        "ttl_s": _n(ttl_seconds(rec.expires_ms)),
        "rev": {"S": rev},
    }
    if rec.fingerprint is not None:
        item["fp"] = {"S": rec.fingerprint}
    if rec.result is not None:
        item["res"] = {"B": bytes(rec.result)}
    if rec.error is not None:
        item["err"] = {"S": rec.error}
    return item


def from_item(item: Item) -> tuple[Record, str]:
    """The record an item holds, and its revision."""
    fp = item.get("fp")
    res = item.get("res")
    err = item.get("err")
    record = new_record(
        consumer=item["c"]["S"],
        key=item["k"]["S"],
        status=_STATUS[item["st"]["S"]],
        fingerprint=None if fp is None else fp["S"],
        token=item["tok"]["S"],
        attempt=int(item["att"]["N"]),
        created_ms=int(item["cr"]["N"]),
        updated_ms=int(item["up"]["N"]),
        lease_until_ms=int(item["lu"]["N"]),
        expires_ms=int(item["ex"]["N"]),
        result=None if res is None else bytes(res["B"]),
        error=None if err is None else err["S"],
    )
    return record, item.get("rev", {}).get("S", "")


def is_record(item: Item) -> bool:
    """Whether ``item`` is a record (not the schema marker, not a stranger's item)."""
    return "c" in item and "k" in item and "st" in item and "ex" in item
