"""Tokens and fingerprints as the SQLite and MariaDB/MySQL stores keep them: as bytes.

oncely's fencing tokens are 32 lowercase hex digits and its fingerprints ``v1:`` and 32 more:
67 characters of every record spent on 33 bytes of information. Kept as bytes, a token is 16
bytes and a fingerprint 17 (a version byte and the digest). With 10^6 records in oncely's
shape (36-character uuid keys, 100-byte results; ``python bench/scale.py --store sqlite
--sizes 1000000``), that is 40 bytes less per record on SQLite and 56 on MariaDB, where the
purge index had added 19% and 27% to the 315 and 422 bytes of a table without it; it now adds
7% and 6.5% (MariaDB's index also ordered by claim time, see its dialect).

Any other value (a token or fingerprint of another shape: a test's ``"t1"``, a fingerprint of
a store of one's own) is kept as its UTF-8 bytes, behind a zero byte wherever it could be read
as a packed one, so every value reads back as exactly the text that was written. Text values
(rows written before the compact form: SQLite gives them back as ``str``, MariaDB as the
text's bytes) read back unchanged too, and the statements that compare against a value read
from a row accept both of its forms, so those rows keep working until they expire. (One value
reads back otherwise from a MariaDB row written in text form: a token of exactly 16 bytes,
which oncely never wrote (its tokens are 32 hex digits), reads as the hex of those bytes; the
compare-and-set on it still holds.)

PostgreSQL keeps ``text`` columns: its rows were 6% larger with the purge index, and changing a
column's type rewrites the table.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "REVISION_NOTE",
    "SCHEMA_REVISION",
    "SCHEMA_VERSION",
    "pack_fingerprint",
    "pack_token",
    "unpack_fingerprint",
    "unpack_token",
]

SCHEMA_VERSION: Final = 2
"""The schema version of the SQLite and MariaDB/MySQL stores that keep tokens and
fingerprints in this form. An oncely that knows only version 1 would take a repeat for a key
conflict, so it refuses such a table."""
SCHEMA_REVISION: Final = 3
"""Their revision: 2 brought the purge_ms column and its index (see
:data:`oncely.stores._sql.PURGE_BUCKET_MS`), 3 schema version 2 (and, on MariaDB/MySQL, the
purge index ordered by the claim's time within a minute)."""
REVISION_NOTE: Final = (
    "the purge index, tokens and fingerprints kept as bytes; workers of an oncely older than "
    "schema version 2 refuse the migrated table, so stop them first"
)
"""What the migration to :data:`SCHEMA_REVISION` brings, for :class:`~oncely.SchemaOutdated`."""

FINGERPRINT_PREFIX: Final = "v1:"
_FINGERPRINT_BYTE: Final = b"\x01"
_ESCAPE: Final = b"\x00"
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_TOKEN_BYTES: Final = 16
_FINGERPRINT_BYTES: Final = 17


def _as_text(value: str, packed_size: int) -> bytes:
    """A value of another shape: its UTF-8 bytes, escaped where they could be read as packed."""
    data = value.encode("utf-8")
    if len(data) == packed_size or data[:1] == _ESCAPE:
        return _ESCAPE + data
    return data


def pack_token(token: str) -> bytes:
    """The stored form of a fencing token: 16 bytes for 32 lowercase hex digits."""
    if len(token) == 32 and _HEX32.match(token):
        return bytes.fromhex(token)
    return _as_text(token, _TOKEN_BYTES)


def unpack_token(stored: bytes | str) -> str:
    """The token a stored value holds (``str``: a row written in text form)."""
    if isinstance(stored, str):
        return stored
    data = bytes(stored)
    if len(data) == _TOKEN_BYTES:
        return data.hex()
    if data[:1] == _ESCAPE:
        data = data[1:]
    return data.decode("utf-8")


def pack_fingerprint(fingerprint: str | None) -> bytes | None:
    """The stored form of a fingerprint: 17 bytes for oncely's ``v1:`` and 32 hex digits."""
    if fingerprint is None:
        return None
    if (
        len(fingerprint) == 35
        and fingerprint.startswith(FINGERPRINT_PREFIX)
        and _HEX32.match(fingerprint, 3)
    ):
        return _FINGERPRINT_BYTE + bytes.fromhex(fingerprint[3:])
    return _as_text(fingerprint, _FINGERPRINT_BYTES)


def unpack_fingerprint(stored: bytes | str | None) -> str | None:
    """The fingerprint a stored value holds (``str``: a row written in text form)."""
    if stored is None or isinstance(stored, str):
        return stored
    data = bytes(stored)
    if len(data) == _FINGERPRINT_BYTES and data[:1] == _FINGERPRINT_BYTE:
        return FINGERPRINT_PREFIX + data[1:].hex()
    if data[:1] == _ESCAPE:
        data = data[1:]
    return data.decode("utf-8")
