"""The store contract, written once. Every store implements it; the contract suite proves it.

Two capability levels. Every store can claim, take over, complete, fail, renew, release, get and
purge (two-phase mode, R10). A *transactional* store can also claim inside a transaction the
caller's code writes in, so the marker and the business writes commit together (R7): the SQL
stores, and DynamoDB's (whose transaction is one ``TransactWriteItems`` sent at its end).

All times are epoch milliseconds from the store's clock, never the worker's. Every fenced write
(complete, fail, renew, release) carries the claim's token and raises :class:`~oncely.LeaseLost`,
changing nothing, when the record is no longer that claim's. The rules are
:mod:`oncely._core.state`; a store behaves exactly like that table.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar, runtime_checkable

from oncely._core.records import Claim, ClaimRequest, Completion, Record, Status, StoreStats
from oncely.errors import LeaseLost

__all__ = [
    "AsyncBoundsResults",
    "AsyncCompletesMany",
    "AsyncForgetsByToken",
    "AsyncKeepsOffsets",
    "AsyncPrepares",
    "AsyncStore",
    "AsyncTransactionalStore",
    "complete_each",
]

Tx = TypeVar("Tx")
Tx_contra = TypeVar("Tx_contra", contravariant=True)


@runtime_checkable
class AsyncStore(Protocol):
    """The operations every store offers."""

    @property
    def url(self) -> str:
        """Where the store lives, with any password replaced by ``***``."""
        ...

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        """Atomically insert an in-progress record for ``(consumer, key)`` unless a live one
        exists, and return the winner (R8, R9). With ``takeover``, a stale in-progress record
        whose fingerprint agrees is taken over (new token, attempt + 1)."""
        ...

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        """:meth:`claim` for many keys in one round trip where the backend allows, for batch
        consumers. The answers come in request order and equal those of the same claims made
        one after the other; a key repeated in one batch is won at most once (the later request
        sees the earlier one's record)."""
        ...

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        """Take over a stale record only while it still carries ``expected_token``; claim
        afresh if it is gone. Used after a reconciler decided to retry."""
        ...

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        """Mark the claim completed with ``result``. Idempotent for the same token."""
        ...

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        """Mark the claim failed for good (a poison message). Idempotent for the same token."""
        ...

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        """Extend the claim's lease to ``now + lease``."""
        ...

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        """Delete the claim so a redelivery starts afresh. False if there was nothing to
        release (already gone or expired)."""
        ...

    async def get(self, consumer: str, key: str) -> Record | None:
        """The unexpired record for ``(consumer, key)``, or None."""
        ...

    async def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        """Delete expired records in batches of ``batch_size`` (each its own short write) and
        return how many were deleted."""
        ...

    async def stats(self, *, exact: bool = True) -> StoreStats:
        """Record counts per consumer and status. ``exact=False`` answers from the
        database's statistics instead of counting (see :class:`~oncely.StoreStats`): no
        read of the whole table, for operators of large ones."""
        ...

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Unexpired records in ``(consumer, key)`` order, starting after ``after``."""
        ...

    async def forget(self, consumer: str, key: str) -> bool:
        """Delete a record whatever its state (an operator's decision). True if one existed."""
        ...

    async def migrate(self) -> int:
        """Create or upgrade the schema; return its version."""
        ...

    async def aclose(self) -> None:
        """Release connections. The store cannot be used afterwards."""
        ...


@runtime_checkable
class AsyncCompletesMany(Protocol):
    """A store that completes a batch of claims in one round trip (every built-in store; a
    store without it is completed one key at a time, :func:`complete_each`)."""

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """:meth:`~AsyncStore.complete` for many claims: one answer per completion, in order,
        the completed record or the :class:`~oncely.LeaseLost` that a lone ``complete`` would
        have raised (returned, not raised, so the rest of the batch still lands). A store
        error raises for the whole batch; completing again with the same tokens is safe."""
        ...


@runtime_checkable
class AsyncForgetsByToken(Protocol):
    """A store that deletes a record only while it is the one an operator read (every
    built-in store). :meth:`~AsyncStore.forget` deletes whatever is there: between reading a
    record and deleting it, it may have expired or been forgotten and claimed afresh by a
    delivery whose worker runs the handler right now. A store without it is forgotten
    unfenced."""

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        """Delete the record only while it carries ``token`` and is no live claim (a settled
        record, or a claim whose lease lapsed). False if there was none (gone or expired);
        :class:`~oncely.LeaseLost`, changing nothing, carrying the record, when it is
        another's or a live claim."""
        ...


@runtime_checkable
class AsyncPrepares(Protocol):
    """A store that can connect and check (or, opened with ``migrate=True``, create) its
    schema on demand, as its first operation would (every built-in store). A consumer calls
    :meth:`prepare` at start, so that a store that is down, or a schema this oncely cannot
    use, stops the start with its error instead of failing each message."""

    async def prepare(self) -> None:
        """Connect and check the schema now; raise what the first operation would."""
        ...


@runtime_checkable
class AsyncBoundsResults(Protocol):
    """A store whose server refuses a value over some size (every built-in store but the
    memory one): the inbox asks it for each result, and a larger one is completed without it,
    as one over ``Limits.max_result_bytes``, instead of being sent and refused after the
    handler ran (the work would then be done again)."""

    def result_room(self) -> tuple[int, str] | None:
        """The most bytes an encoded result may have for the store to keep it, and what sets
        that (said in the record's note); None while unknown (not connected yet)."""
        ...


@runtime_checkable
class AsyncKeepsOffsets(Protocol[Tx_contra]):
    """A store that keeps a partitioned stream's consumed offsets beside the inbox, written in
    the handler's transaction (the SQL and DynamoDB stores): a consumer in the transactional
    mode then starts each partition from what its database says it finished."""

    async def save_offset_in(
        self, tx: Tx_contra, consumer: str, stream: str, part: int, next_offset: int
    ) -> None:
        """In ``tx``: the next offset to read of ``stream``'s partition ``part`` is
        ``next_offset`` (a lower one than kept is ignored: it only moves forward)."""
        ...

    async def offsets(self, consumer: str, stream: str) -> dict[int, int]:
        """The kept next offset of each partition of ``stream``."""
        ...

    async def prepare_offsets(self) -> None:
        """Make ready what :meth:`save_offset_in` writes to (outside any transaction: a
        table created on first use)."""
        ...


async def complete_each(
    store: AsyncStore, consumer: str, completions: Sequence[Completion], *, keep_ms: int
) -> list[Record | LeaseLost]:
    """:meth:`AsyncCompletesMany.complete_many` as one :meth:`~AsyncStore.complete` per key."""
    done: list[Record | LeaseLost] = []
    for c in completions:
        try:
            done.append(
                await store.complete(
                    consumer, c.key, token=c.token, result=c.result, keep_ms=keep_ms, note=c.note
                )
            )
        except LeaseLost as lost:
            done.append(lost)
    return done


@runtime_checkable
class AsyncTransactionalStore(AsyncStore, Protocol[Tx]):
    """A store that can put the dedup marker inside a transaction with the caller's writes."""

    def transaction(self, *, claim_first: bool = False) -> AbstractAsyncContextManager[Tx]:
        """A new transaction on one of the store's connections: committed when the block ends,
        rolled back when it raises.

        ``claim_first=True`` promises that the block's first statement is :meth:`claim_in` on
        the connection it yields (the inbox's transactional mode keeps that promise); the
        store may then start the transaction with that claim instead of on entry, in the
        claim's own round trip. A block that ends before any claim may then have started
        nothing."""
        ...

    def savepoint(self, tx: Tx) -> AbstractAsyncContextManager[None]:
        """A savepoint inside ``tx`` around the block: when the block raises, everything done
        in it is rolled back and ``tx`` stays usable; when it ends normally, its work stays in
        ``tx`` (the store may release the savepoint or leave it for the transaction to absorb,
        whichever costs fewer round trips; a later rollback of the block still targets it)."""
        ...

    def check_transaction(self, tx: Tx) -> None:
        """Raise :class:`~oncely.TransactionRequired` unless ``tx`` has an open transaction."""
        ...

    async def claim_in(
        self,
        tx: Tx,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Claim:
        """:meth:`claim` on ``tx``, inserting the record directly as ``initial`` (completed:
        it commits with the business writes or not at all)."""
        ...

    async def set_result_in(
        self, tx: Tx, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        """Store the result on the marker this transaction inserted."""
        ...
