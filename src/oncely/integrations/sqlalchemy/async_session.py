"""The transactional inbox in an ``AsyncSession`` (source of the generated ``sync_session``,
which does the same in a ``Session``); the contract is in :mod:`oncely.integrations.sqlalchemy`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from oncely._core.outcomes import Handled
from oncely._core.typed import ANNOTATED, typed_repeat
from oncely._twin import ASYNC
from oncely.errors import ConfigurationError, StoreError, TransactionRequired
from oncely.inbox.async_inbox import AsyncInbox, _called
from oncely.integrations._joined.async_identity import check_session_async, store_identity_async
from oncely.integrations._joined.kinds import (
    ASYNC_KINDS,
    SYNC_KINDS,
    check_driver,
    handler_failed,
    kind_of,
    needs_begin,
)
from oncely.stores.async_protocols import AsyncTransactionalStore

if ASYNC:
    if TYPE_CHECKING:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    S = TypeVar("S", "AsyncSession", "AsyncConnection")
    KINDS = ASYNC_KINDS
    NAME, INBOX = "handle_in_session_async", "AsyncInbox"
    OTHER = "use handle_in_session for an Inbox"
else:
    from sqlalchemy import Connection
    from sqlalchemy.orm import Session

    S = TypeVar("S", Session, Connection)
    KINDS = SYNC_KINDS
    NAME, INBOX = "handle_in_session", "Inbox"
    OTHER = "use handle_in_session_async for an AsyncInbox"

__all__ = ["handle_in_session_async"]

P = TypeVar("P")
R = TypeVar("R")


async def handle_in_session_async(
    inbox: AsyncInbox,
    session: S,
    key: str,
    payload: P,
    handler: Callable[[S, P], Awaitable[R]],
    *,
    savepoint: bool = True,
    correlation_id: str | None = None,
    returns: Any = ANNOTATED,
) -> Handled[R]:
    """Run ``handler(session, payload)`` and record ``key`` in the session's transaction (R7).

    ``session`` is a session or connection on the database of ``inbox``'s store, inside a
    transaction you commit (see :mod:`oncely.integrations.sqlalchemy` for the contract, the
    savepoint and the checks). Returns the outcome as :class:`oncely.Handled` (a
    ``duplicate``'s value as the type ``handler`` returns, or ``returns=``, as
    :meth:`oncely.Inbox.handle` gives it); raises
    :class:`~oncely.TransactionsUnsupported` for a store or driver that cannot join,
    :class:`~oncely.ConfigurationError` for a session on another database,
    :class:`~oncely.TransactionRequired` without an open transaction, and
    :class:`~oncely.StoreError` when the store fails (roll back then).
    """
    if not isinstance(inbox, AsyncInbox):
        raise TypeError(f"{NAME} takes an oncely.{INBOX}, not {type(inbox).__name__}; {OTHER}")
    store = inbox.store
    kind = kind_of(store, KINDS, NAME)
    joined = cast("AsyncTransactionalStore[object]", store)
    orm, connection = await _split_async(session)
    if ASYNC:
        fairy = await connection.get_raw_connection()
    else:
        fairy = connection.connection
    driver = fairy.driver_connection
    check_driver(kind, driver, connection.dialect.name, connection.dialect.driver)
    expected = await store_identity_async(joined, kind, inbox.consumer, driver)  # no lock yet
    if orm is not None:
        await orm.flush()  # your pending changes go before the savepoint: a failure keeps them
    if kind.family == "sqlite" and needs_begin(driver):
        await connection.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        joined.check_transaction(driver)
    except TransactionRequired as exc:
        raise TransactionRequired(
            f"{exc}. In SQLAlchemy terms: the session or connection has no open transaction "
            "(an engine with isolation_level='AUTOCOMMIT' never has one): call it inside "
            "session.begin() or engine.begin(), on an engine that is not in autocommit"
        ) from exc
    await check_session_async(
        store.url,
        expected,
        connection,
        fairy,
        lambda: store_identity_async(joined, kind, inbox.consumer, driver, again=True),
    )

    failures: list[Exception] = []

    async def run(_tx: object, body: P) -> R:
        try:
            # (the sync twin refuses an awaitable back: an async handler never runs there)
            result: R = await _called(handler, session, body)
            if orm is not None:
                await orm.flush()  # inside the savepoint: a failing flush fails the handler
        except Exception as exc:
            failures.append(exc)
            raise
        _refuse_other_binds(orm, connection)
        return result

    if not savepoint:
        return typed_repeat(
            await inbox.handle_in_transaction(
                key, payload, run, tx=driver, savepoint=False, correlation_id=correlation_id,
                returns=None,
            ),
            handler,
            returns,
        )  # fmt: skip
    try:
        async with session.begin_nested():
            if orm is not None:
                await (
                    orm.connection()
                )  # a session emits its SAVEPOINT lazily: now, before the claim
            return typed_repeat(
                await inbox.handle_in_transaction(
                    key, payload, run, tx=driver, savepoint=False, correlation_id=correlation_id,
                    returns=None,
                ),
                handler,
                returns,
            )  # fmt: skip
    except StoreError:
        raise
    except Exception as exc:
        lost = _store_error_under(exc)
        if lost is not None:
            # The store's error ended the whole transaction (a MariaDB deadlock rolls it all
            # back), so releasing the savepoint failed on top of it: the store's error is
            # what happened, and what a caller catches (StoreError).
            raise lost from exc
        if not handler_failed(exc, failures):
            raise
        error = exc

    async def again(_tx: object, _body: P) -> R:
        raise error

    return typed_repeat(
        await inbox.handle_in_transaction(
            key, payload, again, tx=driver, savepoint=True, correlation_id=correlation_id,
            returns=None,
        ),
        handler,
        returns,
    )  # fmt: skip


def _refuse_other_binds(orm: object, connection: object) -> None:
    """Raise :class:`~oncely.ConfigurationError` when the session's transaction holds a
    connection besides the one carrying the marker: a session with ``binds`` (or ``bind=`` per
    mapper) writes some classes through another engine, in a transaction of its own that
    commits apart from the marker's (a crash between the two commits keeps one without the
    other), unless the session commits them in two phases (``twophase=True``)."""
    session = getattr(orm, "sync_session", orm)  # an AsyncSession's Session
    if session is None or getattr(session, "twophase", False):
        return
    root = session.get_transaction()  # type: ignore[attr-defined]
    # SQLAlchemy keeps the connections a session's transaction uses in the root's private
    # map (bind -> (connection, ...)); read defensively, as a newer version may move it.
    entries = getattr(getattr(root, "_connections_boundary", root), "_connections", None)
    if not isinstance(entries, dict):
        return
    ours = getattr(connection, "sync_connection", connection)
    others = {
        entry[0] for entry in entries.values() if isinstance(entry, tuple) and entry[0] is not ours
    }
    if others:
        engines = ", ".join(sorted({repr(getattr(c, "engine", c)) for c in others}))
        raise ConfigurationError(
            f"the session also writes through another connection ({engines}) than the one "
            f"oncely's marker is on ({getattr(ours, 'engine', ours)!r}): a session with binds "
            "commits each in a transaction of its own, so the handler's writes and the marker "
            "would not commit together (R7). Keep the handler's tables on the marker's bind, "
            "or use Session(twophase=True)"
        )


def _store_error_under(exc: BaseException) -> StoreError | None:
    """The store's error that ``exc`` was raised while handling (leaving the savepoint block
    after it), if any."""
    seen = exc.__context__
    while seen is not None and seen is not exc:
        if isinstance(seen, StoreError):
            return seen
        seen = seen.__context__
    return None


if ASYNC:

    async def _split_async(
        session: AsyncSession | AsyncConnection,
    ) -> tuple[AsyncSession | None, AsyncConnection]:
        """The session (None for a connection) and the connection its transaction runs on."""
        from sqlalchemy.ext.asyncio import (  # noqa: PLC0415 - needs greenlet
            AsyncConnection,
            AsyncSession,
            async_scoped_session,
        )

        given: object = session  # what a caller may pass, whatever the annotation says
        if isinstance(given, async_scoped_session):
            given = given()  # the registry's session for this scope
        if isinstance(given, AsyncSession):
            return given, await given.connection()
        if isinstance(given, AsyncConnection):
            return None, given
        raise TypeError(
            f"{NAME} takes an AsyncSession or an AsyncConnection (in a transaction), not "
            f"{type(given).__module__}.{type(given).__name__}; a sync Session goes to "
            "handle_in_session"
        )

else:

    def _split(session: Session | Connection) -> tuple[Session | None, Connection]:
        """The session (None for a connection) and the connection its transaction runs on."""
        from sqlalchemy.orm import scoped_session  # noqa: PLC0415

        given: object = session  # what a caller may pass, whatever the annotation says
        if isinstance(given, scoped_session):
            given = given()  # the registry's session (Flask-SQLAlchemy's db.session)
        if isinstance(given, Session):
            return given, given.connection()
        if isinstance(given, Connection):
            return None, given
        raise TypeError(
            f"handle_in_session takes a Session or a Connection (in a transaction), not "
            f"{type(given).__module__}.{type(given).__name__}; an AsyncSession goes to "
            "handle_in_session_async, and an Engine gives a Connection with engine.begin()"
        )
