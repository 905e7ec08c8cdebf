"""Whether a session and a store are on the same database: the reads (source of the generated
``sync_identity``); the comparison is in :mod:`.identity`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from oncely._twin import ASYNC
from oncely.errors import OncelyError, StoreError, StoreUnavailable
from oncely.integrations._joined.kinds import Kind
from oncely.stores._identity import (
    INFO_KEY,
    PROBE,
    SQL,
    Identity,
    identity_of,
    locked_out,
    may_open,
    mismatch,
    remember,
    remembered,
    same_database,
    store_path,
)

if TYPE_CHECKING:
    from sqlalchemy.pool import PoolProxiedConnection

    from oncely.stores.async_protocols import AsyncTransactionalStore

    if ASYNC:
        from sqlalchemy.ext.asyncio import AsyncConnection as SessionConnection
    else:
        from sqlalchemy import Connection as SessionConnection

__all__ = ["check_session_async", "store_identity_async"]


async def store_identity_async(
    store: AsyncTransactionalStore[object],
    kind: Kind,
    consumer: str,
    driver: object,
    *,
    again: bool = False,
) -> Identity:
    """The identity of ``store``'s database (read once per store; ``again``: read anew, as
    after a mismatch, which a server restart causes: PostgreSQL's start time changes). Call it
    before the session's transaction writes on SQLite: opening the store may need SQLite's
    write lock."""
    known = None if again else remembered(store)
    if known is not None:
        return known
    if kind.family == "sqlite":
        # Opens the store (creating its tables unless migrate=False) before the session's
        # transaction holds SQLite's write lock, which the creation would wait for. When the
        # lock is taken already (the session has written), the store reads its schema through
        # the session's own connection instead (missing tables: SchemaMissing at once, never
        # a wait on the session's own lock).
        if may_open(store, driver):
            try:
                await store.get(consumer, PROBE)
            except StoreUnavailable as exc:
                raise locked_out(exc, driver) from exc
        return remember(store, ("sqlite", store_path(store.url) or ""))
    try:
        async with store.transaction() as tx:
            conn: Any = tx
            if kind.family == "postgresql":
                row = await (await conn.execute(SQL[kind.family])).fetchone()
            else:
                cursor = await conn.cursor()
                try:
                    await cursor.execute(SQL[kind.family])
                    row = await cursor.fetchone()
                finally:
                    await cursor.close()
    except OncelyError:
        raise
    except Exception as exc:
        raise StoreError(f"{store.url}: cannot read which database it is in: {exc}") from exc
    return remember(store, (kind.family, *row))


async def check_session_async(
    store_url: str,
    expected: Identity,
    connection: SessionConnection,
    fairy: PoolProxiedConnection,
    again: Callable[[], Awaitable[Identity]],
) -> None:
    """Raise :class:`~oncely.ConfigurationError` unless the session's connection is on the
    database ``expected`` identifies. On a mismatch the store's side is read ``again`` first:
    the one kept may be stale (the server restarted, or failed over, since it was read)."""
    found = cast("Identity | None", fairy.info.get(INFO_KEY))
    if found is None:
        result = await connection.exec_driver_sql(SQL[str(expected[0])])
        found = fairy.info[INFO_KEY] = identity_of(str(expected[0]), [tuple(r) for r in result])
    if same_database(expected, found):
        return
    fresh = await again()
    if not same_database(fresh, found):
        raise mismatch(store_url, fresh, found)
