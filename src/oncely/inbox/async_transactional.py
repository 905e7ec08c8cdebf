"""The inbox's transactional mode (R7, R8): :meth:`~oncely.AsyncInbox.handle_in_transaction`.

The dedup marker is inserted inside the transaction the handler writes in, so marker, business
writes and result commit together or not at all: oncely's own transaction, a savepoint in the
caller's, or the caller's transaction as it is. A crash anywhere leaves either everything or
nothing; a poison message is recorded ``failed`` without its writes.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, nullcontext
from time import perf_counter
from typing import Any, TypeVar

from oncely._core.context import _CURRENT
from oncely._core.flows import Step, decide
from oncely._core.keys import Envelope, KeySource, validate_key
from oncely._core.outcomes import Handled, Outcome, new_handled
from oncely._core.records import ClaimStatus, Record, Status, new_record
from oncely.errors import Reject, TransactionsUnsupported
from oncely.inbox.async_base import InboxBase, new_token, reclaim_reason
from oncely.inbox.async_types import AsyncTxHandler
from oncely.stores.async_protocols import AsyncTransactionalStore

__all__ = ["TransactionalMode"]

P = TypeVar("P")
R = TypeVar("R")
Tx = TypeVar("Tx")

_PROCESSED_LEVEL = Outcome.PROCESSED.log_level


class _HandlerError(Exception):
    """Carries a handler's exception out of a transaction block so the block rolls back."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class TransactionalMode(InboxBase):
    """Claim the key and run the handler in one transaction of a SQL store (R7)."""

    __slots__ = ()

    async def handle_in_transaction(
        self,
        key: str,
        payload: P,
        handler: AsyncTxHandler[Tx, P, R],
        *,
        tx: Tx | None = None,
        savepoint: bool = True,
        correlation_id: str | None = None,
    ) -> Handled[R]:
        """Run ``handler(tx, payload)`` and record ``key`` in the same transaction (R7).

        Without ``tx``, oncely opens a transaction on one of the store's connections and commits
        it. With ``tx`` (a connection of yours with an open transaction on the store's
        database), *you* commit: until then ``processed`` is tentative, and if you roll back
        nothing was recorded. oncely then works inside a savepoint, so a failing handler is
        rolled back alone and your transaction stays usable; with ``savepoint=False`` it adds
        only the claim to your transaction (one round trip), and a handler's exception
        (:class:`~oncely.Reject` included) propagates unchanged: your transaction must then
        roll back, as a ``with`` block does.

        Outcomes are those of :meth:`handle`; ``failed`` means the handler raised and its
        writes were rolled back with the marker, so a redelivery retries. A result that cannot
        be stored also fails the transaction (nothing happened, so nothing is lost).
        """
        # The hot path of the transactional mode: every call layer and temporary object here
        # costs a fixed share of each message's time, so the admission step and the outcome
        # of a new key are written inline (the rules stay in validate_key, the fingerprinter
        # and decide).
        started = perf_counter()
        try:
            checked = validate_key(key, self._limits)
            fp = self._fingerprint(payload)
        except Exception as exc:
            return self._refused(key, exc, started, correlation_id)
        store: AsyncTransactionalStore[Tx] | None = self._tx_store
        if store is None:
            raise TransactionsUnsupported(
                f"{type(self._store).__name__} cannot join a transaction; use the two-phase "
                "mode (Inbox.handle) for it, or a SQL store for the transactional mode"
            )
        token = new_token()
        consumer = self._consumer
        # One body for the three ways in: oncely's own transaction, a savepoint in the
        # caller's, or the caller's transaction as it is.
        block: AbstractAsyncContextManager[Any]
        if tx is None:
            block = store.transaction(claim_first=True)  # the claim is the first statement
        else:
            store.check_transaction(tx)
            block = store.savepoint(tx) if savepoint else nullcontext()
        try:
            async with block as opened:
                # Any: mypy does not narrow ``Tx | None`` here; ``opened`` is the Tx then.
                conn: Any = tx if tx is not None else opened
                claim = await store.claim_in(
                    conn,
                    consumer,
                    checked,
                    fingerprint=fp,
                    token=token,
                    keep_ms=self._keep_ms,
                    takeover=self._takeover,
                )
                step = decide(claim, fp)
                record = claim.record
                value: R | None = None
                if step is Step.PROCEED:
                    context = _CURRENT.set(
                        (consumer, checked, record.attempt, correlation_id, "transactional")
                    )
                    try:
                        value = await handler(conn, payload)
                        data = None if value is None else self._encode(value, strict=True)[0]
                    except Exception as exc:
                        raise _HandlerError(exc) from exc
                    finally:
                        _CURRENT.reset(context)
                    if data is not None:
                        await store.set_result_in(conn, consumer, checked, token=token, result=data)
                        record = _with_result(record, data)
        except _HandlerError as failure:
            error = failure.error
            if tx is not None and not savepoint:
                raise error from None  # the caller's transaction rolls back
            if isinstance(error, Reject):
                await self._reject_in(store, tx, checked, fp, error.reason)
                return self._rejected(checked, error.reason, started, correlation_id)
            return self._failed(checked, error, started, correlation_id)
        if step is not Step.PROCEED:
            return self._settle(step, claim, correlation_id, started)
        if claim.status is ClaimStatus.NEW:
            handled: Handled[R] = new_handled(
                Outcome.PROCESSED,
                consumer,
                checked,
                value,
                None,
                None,
                record,
                record.attempt,
                perf_counter() - started,
                correlation_id,
            )
            observer = self._observer
            if observer.hooks or observer.logger.isEnabledFor(_PROCESSED_LEVEL):
                observer.emit(handled)  # (skipped when nothing would come of it)
            return handled
        return self._done(
            Outcome.STALE_RECLAIMED,
            checked,
            started,
            value=value,
            record=record,
            correlation_id=correlation_id,
            reason=reclaim_reason(claim),
        )

    async def handle_message_in_transaction(
        self,
        envelope: Envelope,
        handler: AsyncTxHandler[Tx, object, R],
        *,
        key: KeySource | None = None,
        tx: Tx | None = None,
        savepoint: bool = True,
    ) -> Handled[R]:
        """:meth:`handle_in_transaction` for a broker message, with the key read as
        :meth:`handle_message` reads it: a message without a usable key is ``rejected``."""
        found: str | Handled[R] = self._message_key(envelope, key, perf_counter())
        if isinstance(found, Handled):
            return found
        return await self.handle_in_transaction(
            found,
            envelope.body,
            handler,
            tx=tx,
            savepoint=savepoint,
            correlation_id=envelope.correlation_id,
        )

    async def _reject_in(
        self,
        store: AsyncTransactionalStore[Tx],
        tx: Tx | None,
        key: str,
        fp: str | None,
        reason: str,
    ) -> None:
        # The handler's writes were rolled back; record the poison key so redeliveries are
        # rejected without running the handler again (in the caller's transaction, or in one
        # of oncely's own).
        block: AbstractAsyncContextManager[Tx] = (
            store.transaction() if tx is None else nullcontext(tx)
        )
        async with block as conn:
            await store.claim_in(
                conn,
                self._consumer,
                key,
                fingerprint=fp,
                token=new_token(),
                keep_ms=self._keep_failed_ms,
                takeover=self._takeover,
                initial=Status.FAILED,
                error=reason[: self._limits.max_error_chars],
            )


def _with_result(record: Record, result: bytes) -> Record:
    # dataclasses.replace, without its field introspection (it is on the hot path).
    return new_record(
        record.consumer,
        record.key,
        record.status,
        record.fingerprint,
        record.token,
        record.attempt,
        record.created_ms,
        record.updated_ms,
        record.lease_until_ms,
        record.expires_ms,
        result,
        record.error,
    )
