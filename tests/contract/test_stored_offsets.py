"""Stored offsets (``store_offsets``): what the SQL stores refuse to keep as a partition's
position, on the real databases. A position that is not one (a float, a bool, an offset past
Kafka's 64-bit range, a stream name a database cannot hold) is a ConfigurationError at the
call, and nothing is written: before, a float offset was rounded up (1.5 kept as 2, past the
record at offset 1), a bool kept as partition 1, and the rest surfaced as the driver's own
exception (``UnicodeEncodeError``, ``AttributeError``) or a database error."""

from __future__ import annotations

from typing import Any

import pytest

import oncely
from oncely.stores.async_protocols import AsyncKeepsOffsets, AsyncTransactionalStore
from tests.backends import Backend, Scope

pytestmark = pytest.mark.services

BAD_POSITIONS: list[tuple[Any, Any, Any, Any]] = [
    ("c", "t", 0, 1.5),  # a float offset: rounded up by the database
    ("c", "t", 0.0, 1),
    ("c", "t", True, 1),  # a bool is no partition
    ("c", "t", 0, False),
    ("c", "t", 0, 2**63),  # past Kafka's offsets (a signed 64-bit integer)
    ("c", "t", 2**31, 1),  # past Kafka's partitions (a signed 32-bit integer)
    ("c", "t", -1, 1),
    ("c", "t", 0, -1),
    ("c", "", 0, 1),
    ("c", "t" * 256, 0, 1),
    ("c", "t\x00", 0, 1),  # NUL: PostgreSQL cannot hold it, MariaDB would
    ("c", "t\udc80", 0, 1),  # not UTF-8
    ("c", b"t", 0, 1),
    ("", "t", 0, 1),
    (None, "t", 0, 1),
    ("c\udc80", "t", 0, 1),
]


async def test_r4_a_position_that_is_not_one_is_refused_and_nothing_is_kept(
    backend: Backend, scope: Scope
) -> None:
    store = backend.make_async(scope, None)
    if not isinstance(store, AsyncKeepsOffsets) or not isinstance(store, AsyncTransactionalStore):
        pytest.skip(f"{backend.name} keeps no offsets")
    try:
        await store.prepare_offsets()
        for consumer, stream, part, offset in BAD_POSITIONS:
            with pytest.raises(oncely.ConfigurationError):
                async with store.transaction() as tx:
                    await store.save_offset_in(tx, consumer, stream, part, offset)
        assert await store.offsets("c", "t") == {}  # nothing of them was kept
        for consumer, stream in [("c", "t\x00"), ("c", "t\udc80"), ("", "t"), (None, "t")]:
            with pytest.raises(oncely.ConfigurationError):
                await store.offsets(consumer, stream)  # type: ignore[arg-type]
        async with store.transaction() as tx:  # the limits themselves are kept
            await store.save_offset_in(tx, "c", "t", 2**31 - 1, 2**63 - 1)
        assert await store.offsets("c", "t") == {2**31 - 1: 2**63 - 1}
    finally:
        await store.aclose()
