"""Consumed offsets kept beside the inbox, written in the handler's transaction.

A consumer of a partitioned log (Kafka) in the transactional mode can keep, per partition, the
offset to read next in the same transaction as the marker and its business writes, and start
from it when the partition is assigned: the database then says how far the consumer got even
when the broker's own commit was lost, and whatever the inbox's retention.

The table is ``<inbox table>_offsets``: one row per (consumer, stream, partition) holding the
next offset, which only moves forward (a write never lowers it). It is created on first use
(``CREATE TABLE IF NOT EXISTS``), and only by a consumer that keeps offsets; an older oncely
never looks at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from oncely.errors import ConfigurationError
from oncely.stores._sql import check_identifier

__all__ = ["MAX_STREAM_CHARS", "OffsetSQL", "check_position"]

MAX_STREAM_CHARS = 255
"""The longest stream (topic) name kept: Kafka's own limit is 249 characters."""

Q = TypeVar("Q", str, bytes)


MAX_PART = 2**31 - 1
"""The highest partition kept: Kafka's partitions are signed 32-bit integers."""
MAX_OFFSET = 2**63 - 1
"""The highest offset kept: Kafka's offsets are signed 64-bit integers."""


def _text(value: object, what: str, most: int | None = None) -> str:
    """``value`` as a name the offsets table can hold: a string (of 1 to ``most``
    characters, or non-empty), UTF-8, with no NUL."""
    if not isinstance(value, str):
        raise ConfigurationError(
            f"the {what} of stored offsets is a str, not {type(value).__name__}"
        )
    if most is not None and not 0 < len(value) <= most:
        raise ConfigurationError(f"a {what} for stored offsets has 1 to {most} characters")
    if not value:
        raise ConfigurationError(f"the {what} of stored offsets is never empty")
    if "\x00" in value:
        raise ConfigurationError(f"the {what} of stored offsets cannot hold a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(f"the {what} of stored offsets is not UTF-8") from None
    return value


_UNCHECKED: Any = object()


def check_position(stream: str, part: int, next_offset: int, *, consumer: str = _UNCHECKED) -> None:
    """Refuse what cannot be a partition's position (and, where given, its consumer's name):
    a ConfigurationError before the database sees it. A float or a bool is no offset (a
    database would round 1.5 up to 2, past the record at 1)."""
    if consumer is not _UNCHECKED:
        _text(consumer, "consumer")
    _text(stream, "stream name", MAX_STREAM_CHARS)
    for value, what, most in ((part, "partition", MAX_PART), (next_offset, "offset", MAX_OFFSET)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"a stored {what} is an int, not {type(value).__name__}")
        if value < 0:
            raise ConfigurationError("a partition and an offset are never negative")
        if value > most:
            raise ConfigurationError(f"a stored {what} is at most {most}, not {value}")


@dataclass(frozen=True, slots=True)
class OffsetSQL(Generic[Q]):
    """The three statements of the offsets table in one dialect."""

    create: Q
    read: Q
    """Parameters ``consumer``, ``stream``; rows ``(part, next_offset)``."""
    save: Q
    """Parameters ``consumer``, ``stream``, ``part``, ``next``: the row moves forward only."""
    binary: bool = False
    """Text columns are ``VARBINARY`` (MariaDB): names are bound as UTF-8 bytes."""

    def params(self, consumer: str, stream: str, **more: int) -> dict[str, Any]:
        if self.binary:
            return {"consumer": consumer.encode("utf-8"), "stream": stream.encode(), **more}
        return {"consumer": consumer, "stream": stream, **more}

    @staticmethod
    def postgres(schema: str, table: str) -> OffsetSQL[bytes]:
        name = check_identifier(f"{table}_offsets")
        t = f'"{check_identifier(schema)}"."{name}"'
        return OffsetSQL(
            create=f"""CREATE TABLE IF NOT EXISTS {t} (
                consumer TEXT COLLATE "C" NOT NULL,
                stream TEXT COLLATE "C" NOT NULL,
                part INTEGER NOT NULL,
                next_offset BIGINT NOT NULL,
                PRIMARY KEY (consumer, stream, part))""".encode(),
            read=(
                f"SELECT part, next_offset FROM {t} "
                "WHERE consumer = %(consumer)s AND stream = %(stream)s"
            ).encode(),
            save=(
                f"INSERT INTO {t} AS o (consumer, stream, part, next_offset) "
                "VALUES (%(consumer)s, %(stream)s, %(part)s, %(next)s) "
                "ON CONFLICT (consumer, stream, part) DO UPDATE "
                "SET next_offset = GREATEST(o.next_offset, EXCLUDED.next_offset)"
            ).encode(),
        )

    @staticmethod
    def mysql(table: str, consumer_bytes: int) -> OffsetSQL[str]:
        t = f"`{check_identifier(f'{table}_offsets')}`"
        return OffsetSQL(
            create=f"""CREATE TABLE IF NOT EXISTS {t} (
                consumer VARBINARY({consumer_bytes}) NOT NULL,
                stream VARBINARY({MAX_STREAM_CHARS * 4}) NOT NULL,
                part INT NOT NULL,
                next_offset BIGINT NOT NULL,
                PRIMARY KEY (consumer, stream, part)
            ) ENGINE=InnoDB""",
            read=(
                f"SELECT part, next_offset FROM {t} "
                "WHERE consumer = %(consumer)s AND stream = %(stream)s"
            ),
            save=(
                f"INSERT INTO {t} (consumer, stream, part, next_offset) "
                "VALUES (%(consumer)s, %(stream)s, %(part)s, %(next)s) "
                "ON DUPLICATE KEY UPDATE next_offset = GREATEST(next_offset, VALUES(next_offset))"
            ),
            binary=True,
        )

    @staticmethod
    def sqlite(table: str) -> OffsetSQL[str]:
        t = check_identifier(f"{table}_offsets")
        return OffsetSQL(
            create=f"""CREATE TABLE IF NOT EXISTS {t} (
                consumer TEXT NOT NULL,
                stream TEXT NOT NULL,
                part INTEGER NOT NULL,
                next_offset INTEGER NOT NULL,
                PRIMARY KEY (consumer, stream, part)) WITHOUT ROWID""",
            read=(
                f"SELECT part, next_offset FROM {t} WHERE consumer = :consumer AND stream = :stream"
            ),
            save=(
                f"INSERT INTO {t} (consumer, stream, part, next_offset) "
                "VALUES (:consumer, :stream, :part, :next) "
                "ON CONFLICT (consumer, stream, part) DO UPDATE "
                "SET next_offset = max(next_offset, excluded.next_offset)"
            ),
        )
