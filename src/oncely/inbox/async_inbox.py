"""The inbox: runs a handler for each logical message effectively once (R1).

Two modes, one decision table (:mod:`oncely._core.flows`):

* **Transactional** (:meth:`AsyncInbox.handle_in_transaction`, R7, R8): the dedup marker is
  inserted inside the transaction the handler writes in, so marker, business writes and result
  commit together or not at all. A crash anywhere leaves either everything or nothing; a poison
  message is recorded ``failed`` without its writes.
* **Two-phase** (:meth:`AsyncInbox.handle`, R10): for effects outside any transaction (an HTTP
  call, an e-mail). The key is claimed ``in_progress`` under a lease that a heartbeat renews; the
  result is recorded under the claim's fencing token (a short store outage is ridden out, since
  the effects are done); a failure releases the claim so a redelivery retries; a lapsed lease
  goes through the ``on_stale`` policy or its reconciler.

:class:`AsyncInbox` is one class: the I/O of both modes against its store. What needs no I/O
(admission, encoding, the outcome of each step, fencing tokens) is decided by the pure
:class:`~oncely._core.inbox_rules.InboxRules` it holds, written once for this class and its
generated sync twin :class:`~oncely.Inbox`.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import Semaphore, create_task, gather, sleep, wait
    from inspect import isawaitable

    from oncely._core.handlers import refuse_generator, refuse_unrun
else:
    from threading import Semaphore
    from time import sleep

    from oncely._core.handlers import refuse_async, sync_result

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from datetime import timedelta
from time import perf_counter, time
from typing import Any, Generic, Literal, ParamSpec, Self, TypeAlias, TypeVar, cast

from oncely._core.codec import Codec, JSONCodec
from oncely._core.context import _CURRENT, downstream_key, outer_correlation_id
from oncely._core.fingerprint import Fingerprinter, scoped
from oncely._core.fingerprint import fingerprint as payload_fingerprint
from oncely._core.flows import Step, decide
from oncely._core.handlers import function_name, refuse_result, refuse_store_kind
from oncely._core.inbox_rules import (
    InboxRules,
    lost_reason,
    new_token,
    not_kept_note,
    reclaim_reason,
    result_lost,
    with_result,
)
from oncely._core.keys import Envelope, KeySource, validate_consumer, validate_key
from oncely._core.observe import Hook, Observer, key_for_logs, redact_keys
from oncely._core.outcomes import Handled, Outcome, Released
from oncely._core.policy import (
    AsyncReconciler,
    Lease,
    Limits,
    OnStale,
    Resolution,
    Resolved,
    Retention,
    StaleClaim,
)
from oncely._core.records import Claim, ClaimRequest, ClaimStatus, Completion, Record, Status
from oncely._core.said import said
from oncely._core.typed import ANNOTATED, ResultWatch, annotated, result_type, reviver, typed_repeat
from oncely.errors import (
    ClaimEnded,
    CommitRefused,
    ConfigurationError,
    HandlerRefused,
    InvalidKey,
    KeyConflict,
    KeyTaken,
    LeaseLost,
    PayloadError,
    Reject,
    ResolveRefused,
    ResultTooLarge,
    ResultUnavailable,
    StoreError,
    StoreUnavailable,
    TransactionEnded,
    TransactionsUnsupported,
)
from oncely.inbox._gather import Gather
from oncely.inbox.async_types import AsyncFunction, AsyncHandler, AsyncTxHandler
from oncely.inbox.heartbeats import AsyncHeartbeats, AsyncTicket
from oncely.stores.async_protocols import (
    AsyncCompletesMany,
    AsyncForgetsByToken,
    AsyncPrepares,
    AsyncStore,
    AsyncTransactionalStore,
    complete_each,
)
from oncely.wire import printable

__all__ = ["AsyncClaimed", "AsyncInbox"]

P = TypeVar("P")
R = TypeVar("R")
Tx = TypeVar("Tx")
PS = ParamSpec("PS")
Early: TypeAlias = Callable[[list[int], list[Handled[R]]], Awaitable[None]]
"""Told the outcomes of a batch's groups that ended early: their indexes and outcomes."""

_COMPLETE_PAUSES = (0.05, 0.2, 0.8, None)  # pauses between tries; None: the last try
_COMPLETE_WITHIN = sum(p for p in _COMPLETE_PAUSES if p is not None)
"""Seconds after its first try that a completion may start another: the tries ride out an
outage of about a second. A try that waits on the store's own timeouts (PostgreSQL's
``connect_timeout``, 10 s, while the server does not answer) counts against it, so a store
that stays away costs about a second plus one try's timeout, never four tries' timeouts."""


def _retry_complete(first: float, pause: float | None) -> bool:
    """Whether a completion whose first try started at ``first`` (``perf_counter``) tries
    again after ``pause``."""
    return pause is not None and perf_counter() - first + pause <= _COMPLETE_WITHIN


_MAX_ROUNDS = 8


def _kept(record: Record | None, keep_ms: int, keep_failed_ms: int) -> tuple[int, int]:
    """How long a resolution keeps ``record`` (completed, failed): this inbox's retention,
    and never less than the record's own, which its last write set (``expires_ms -
    updated_ms``, the consumer's retention when it claimed). An operator's ``--keep`` left at
    its default must not cut a record short: its message could come back (a resubmission
    from the dead-letter queue) after the record is gone and run again (R13)."""
    if record is None:
        return keep_ms, keep_failed_ms
    own = max(record.expires_ms - record.updated_ms, 0)
    return max(keep_ms, own), max(keep_failed_ms, own)


def _completions(
    finished: list[tuple[int, Claim, Any, bytes | None, str | None]],
) -> list[Completion]:
    """The completions of a batch's finished handlers, in the batch's order (``finished``
    is sorted in place, so its answers line up with it)."""
    finished.sort(key=lambda done: done[0])
    return [
        Completion(claim.record.key, claim.record.token, data, note)
        for _i, claim, _result, data, note in finished
    ]


class _Decorated:
    """What an ``@idempotent`` function's calls share: its scope, the type its repeats are
    rebuilt as, and the watch on results a repeat would not give back as they were."""

    __slots__ = ("convert", "fn", "rules", "scope", "wanted", "watch")

    def __init__(self, fn: Callable[..., Any], scope: str, returns: Any, rules: InboxRules):
        self.fn = fn
        self.scope = scope
        self.rules = rules
        self.wanted = result_type(fn, returns)
        self.convert = reviver(self.wanted)
        unannotated = returns is ANNOTATED and "return" not in getattr(
            annotated(fn), "__annotations__", {}
        )
        self.watch = (
            ResultWatch(scope, rules.observer.logger)
            if unannotated and isinstance(rules.codec, JSONCodec)
            else None
        )

    def returned(self, handled: Handled[Any]) -> Any:
        """What a call answers with ``handled``: the result, a repeat's rebuilt as the
        function's type, or the exception a call raises instead."""
        name = function_name(self.fn)
        outcome = handled.outcome
        if outcome is Outcome.KEY_CONFLICT:
            raise self._conflict(handled)
        value = handled.unwrap()
        if outcome is not Outcome.DUPLICATE:
            if self.watch is not None:
                self.watch.see(value)
            return value
        if value is None:
            if result_lost(handled.reason):
                raise ResultUnavailable(
                    f"{name} ran for {handled.key!r} before, but its result is not there to "
                    f"return ({handled.reason}); it is not run again",
                    cast("Handled[object]", handled),
                )
            return None
        try:
            return self.convert(value)
        except Exception as exc:
            raise PayloadError(
                f"the stored result of {handled.key!r} cannot be read back as "
                f"{self.wanted!r}: {said(exc)}"
            ) from exc

    def _conflict(self, handled: Handled[Any]) -> KeyConflict:
        name = function_name(self.fn)
        return KeyConflict(
            f"{name} was not run: the key {self.rules.shown(handled.key or '')!r} is already "
            f"recorded on this inbox (consumer {handled.consumer!r}) by another function, or "
            f"by {name} with other arguments. A key belongs to one function: give each "
            'function its own keys (key=lambda order: f"receipt:{order}"). A function '
            'renamed or moved keeps the keys it recorded before with scope="old.module.'
            f"name\" (this one's scope is {self.scope!r}).",
            cast("Handled[object]", handled),
        )


def _instance_parameter(signature: inspect.Signature) -> str | None:
    """The name of a method's first parameter when it is ``self`` or ``cls`` (the function
    is decorated in a class body): the instance is left out of the fingerprinted payload."""
    first = next(iter(signature.parameters), None)
    return first if first in ("self", "cls") else None


async def _called(handler: Callable[..., Any], *args: Any) -> Any:
    """``handler(*args)``'s result: awaited (the asyncio inbox takes a plain function's value
    as it is), or refused when the sync inbox got an awaitable back."""
    if ASYNC:
        returned = handler(*args)
        if isawaitable(returned):
            return await returned
        refuse_unrun(returned, handler)  # a generator: its body never ran
        return returned
    else:
        return sync_result(handler(*args), handler)


async def _joinable(store: AsyncTransactionalStore[Tx], tx: Tx) -> None:
    """Raise unless ``tx``, a caller's connection, can take the marker: an open transaction
    (:class:`~oncely.TransactionRequired`), on the store's database (a marker committed in
    another would never be read: :class:`~oncely.ConfigurationError`; oncely's SQL stores
    check, a store of another kind may not)."""
    store.check_transaction(tx)
    on_database = getattr(store, "check_database", None)
    if on_database is not None:
        await on_database(tx)


async def _called_in(store: object, handler: Callable[..., Any], conn: Any, payload: Any) -> Any:
    """``handler(conn, payload)`` in the transaction the claim opened, which must still be
    open when it returns: a handler that committed or rolled back ended it (the claim with
    it), so its writes and the marker no longer commit together."""
    value = await _called(handler, conn, payload)
    inside = getattr(store, "in_transaction", None)
    if inside is not None and not inside(conn):
        note = getattr(store, "ended_note", None)
        raise TransactionEnded(
            "the handler ended the transaction it was given (it committed or rolled back): "
            "its writes and the key's marker no longer commit together. A handler never "
            "commits or rolls back that transaction: oncely, or your code around the call, does"
            + (note(conn) if note is not None else "")
        )
    return value


async def _keep_result(
    store: AsyncTransactionalStore[Tx],
    conn: Tx,
    consumer: str,
    key: str,
    token: str,
    data: bytes | None,
) -> None:
    """Store the handler's result with the claim made on ``conn``; without a result, look for
    the claim where the store can tell it is gone (a server that rolls a transaction back
    and goes on: MariaDB's deadlock victim, whose handler caught the error). Either raises
    :class:`~oncely.TransactionEnded` when the claim is gone. A result over what the
    connection takes (MariaDB/MySQL's ``max_allowed_packet`` of a caller's older session)
    fails the transaction as one over ``max_result_bytes`` does: a handler's failure."""
    if data is not None:
        try:
            await store.set_result_in(conn, consumer, key, token=token, result=data)
        except ResultTooLarge as exc:
            raise _HandlerError(exc) from exc
        return
    held_in = getattr(store, "held_in", None)
    if held_in is not None:
        await held_in(conn, consumer, key, token=token)


class _HandlerError(Exception):
    """Carries a handler's exception out of a transaction block so the block rolls back."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class AsyncInbox:
    """Processes each logical message once for one consumer, on top of a store.

    ``consumer`` scopes every record (R5): give each independent subscriber of a channel its
    own name and they never stop one another. The store may be shared by many inboxes.

    Raises :class:`~oncely.ConfigurationError` for a policy that cannot work (a lease longer
    than retention, a blank consumer). Message-level problems never raise: they come back as
    outcomes (:class:`~oncely.Handled`). A store failure raises :class:`~oncely.StoreError`,
    after which nothing was acknowledged and retrying the message later is safe.
    """

    # The hot path reads its configuration from its own slots (the rules hold the same
    # values): one attribute lookup per field instead of two, on every message.
    __slots__ = (
        "_consumer",
        "_fingerprint",
        "_heartbeats",
        "_keep_failed_ms",
        "_keep_ms",
        "_lease",
        "_lease_ms",
        "_limits",
        "_reconciler",
        "_renew_every",
        "_retention",
        "_rules",
        "_store",
        "_takeover",
        "_tx_store",
    )

    def __init__(
        self,
        store: AsyncStore,
        *,
        consumer: str,
        retention: Retention | None = None,
        lease: Lease | None = None,
        on_stale: OnStale | Literal["retry", "escalate"] | AsyncReconciler = OnStale.RETRY,
        fingerprint: Fingerprinter = payload_fingerprint,
        limits: Limits | None = None,
        codec: Codec | None = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
        logger: logging.Logger | None = None,
        log_keys: Literal["plain", "hash"] = "plain",
    ) -> None:
        if ASYNC:
            refuse_store_kind(store, asynchronous=True)
        else:
            refuse_store_kind(store, asynchronous=False)
        self._store = store
        # Checked once: a runtime Protocol check costs tens of microseconds per call.
        self._tx_store: AsyncTransactionalStore[Any] | None = (
            store if isinstance(store, AsyncTransactionalStore) else None
        )
        self._consumer = validate_consumer(consumer)
        self._retention = retention if retention is not None else Retention()
        self._lease = lease if lease is not None else Lease()
        if self._lease.duration >= self._retention.keep:
            raise ConfigurationError(
                "the lease must be shorter than retention: a record must outlive its claim"
            )
        self._lease_ms = self._lease.duration_ms
        self._keep_ms = self._retention.keep_ms
        self._keep_failed_ms = self._retention.keep_failed_ms
        self._renew_every = self._lease.renew_every_s
        if callable(on_stale) and not isinstance(on_stale, str):
            self._reconciler: AsyncReconciler | None = on_stale
            self._takeover = False
        else:
            self._reconciler = None
            self._takeover = OnStale(on_stale) is OnStale.RETRY
        self._fingerprint = fingerprint
        self._limits = limits if limits is not None else Limits()
        self._rules = InboxRules(
            self._consumer,
            fingerprint=fingerprint,
            limits=self._limits,
            codec=codec if codec is not None else JSONCodec(),
            observer=Observer(hooks=hooks, logger=logger, log_keys=log_keys),
            # A store whose server bounds a statement (MariaDB/MySQL's max_allowed_packet):
            # a result over it is not kept, as one over max_result_bytes.
            room=getattr(store, "result_room", None),
        )
        self._heartbeats = AsyncHeartbeats()

    @staticmethod
    def _refuse_async(handler: object) -> None:
        """Neither inbox can run a generator function, nor the sync one an async handler:
        refused before anything is claimed (:mod:`oncely._core.handlers`). The asyncio inbox
        runs a plain function and takes its value as it is (see :meth:`_invoke`)."""
        if ASYNC:
            refuse_generator(handler)
        else:
            refuse_async(handler)

    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def store(self) -> AsyncStore:
        return self._store

    @property
    def limits(self) -> Limits:
        """The bounds on keys, payloads and stored results this inbox enforces."""
        return self._limits

    @property
    def retention(self) -> Retention:
        """How long this inbox keeps records (R13)."""
        return self._retention

    @property
    def log_keys(self) -> Literal["plain", "hash"]:
        """How keys show in its log lines (``"hash"``: a digest, never the key): a consumer
        that logs its messages' keys shows them the same way (R16)."""
        return self._rules.observer.log_keys

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        """The ``rejected`` outcome for a message that cannot be processed at all (a body that
        does not decode, a message too large): logged and passed to hooks like every outcome,
        so an adapter dead-letters it with ``reason`` instead of dropping it. No record is
        written: nothing was claimed."""
        return self._rules.refuse(reason, key=key, correlation_id=correlation_id)

    async def handle_batch(
        self,
        items: Sequence[tuple[str, P]],
        handler: AsyncHandler[P, R],
        *,
        correlation_id: str | None = None,
        groups: Sequence[Hashable] | None = None,
        concurrency: int = 1,
        stop: Callable[[Hashable], bool] | None = None,
    ) -> list[Handled[R]]:
        """:meth:`handle` for a batch of ``(key, payload)`` pairs, as a batch consumer receives
        them (a Redis Streams read with ``COUNT``, a Kafka poll, an SQS receive).

        All keys are claimed in one round trip (:meth:`~oncely.AsyncStore.claim_many`); the
        handler runs for each key this call won; the handlers that returned are completed
        together in one round trip at the end (``complete_many``), a handler that raised is
        released (or failed, for :class:`~oncely.Reject`) at once. Returns one outcome per item,
        in the order given. A key repeated within the batch is processed once: a later copy
        with the same content is its ``duplicate`` once the first completed (``in_flight``,
        to be delivered again, when it did not), one with other content a ``key_conflict``.

        ``groups`` gives each item an ordering group (a Kafka partition, an SQS FIFO message
        group): items of one group run one after the other, in the order given, and once one
        of them fails or is given back (``in_flight``: its key held elsewhere, found so by the
        batch's claim or while its group ran), the later ones of its group are not run: their
        claims are released and they come back ``in_flight`` (to be delivered again, after
        that one). Without ``groups`` every item is in one group, held back after a failure
        only (an item given back does not stop a batch without groups). Up to
        ``concurrency`` groups run at once (in the asyncio inbox; the sync one runs them one
        after the other). A won claim waits for the end of the batch to be completed, its
        lease renewed by the heartbeat meanwhile, as is every claim the batch holds (one
        waiting behind its group too).
        ``stop(group)`` is asked
        before each handler starts: once it answers true (the consumer is shutting down, the
        group's partition was revoked), the group's items not started yet are released and come
        back ``in_flight`` too.
        """
        started = perf_counter()
        if correlation_id is None:
            correlation_id = outer_correlation_id()
        entries = [(key, payload, correlation_id) for key, payload in items]
        return await self._batch(entries, handler, groups, concurrency, stop, started)

    async def handle_messages(
        self,
        envelopes: Sequence[Envelope],
        handler: AsyncHandler[object, R],
        *,
        key: KeySource | None = None,
        groups: Sequence[Hashable] | None = None,
        concurrency: int = 1,
        stop: Callable[[Hashable], bool] | None = None,
        settled: Early[R] | None = None,
        slots: Semaphore | None = None,
    ) -> list[Handled[R]]:
        """:meth:`handle_batch` for broker messages: each key comes from ``key`` (default: the
        producer's message id) and each message keeps its correlation id. A message without a
        usable key is ``rejected`` with the reason, never processed unprotected (R2-R4).

        For a consumer that settles messages as they end (asyncio only): ``settled(indexes,
        outcomes)`` is called with the outcomes of the groups that ended while others still
        run, their completions gathered over a short wait into one ``complete_many`` (so a
        slow handler holds up its own group, not the others'); they are in the list returned
        too. ``slots``, a semaphore shared by several batches, bounds their groups together
        in place of ``concurrency``."""
        started = perf_counter()
        entries: list[tuple[str | Handled[R], object, str | None]] = [
            (self._rules.message_key(e, key, started), e.body, e.correlation_id) for e in envelopes
        ]
        return await self._batch(
            entries, handler, groups, concurrency, stop, started, settled=settled, slots=slots
        )

    async def _batch(
        self,
        entries: Sequence[tuple[str | Handled[R], Any, str | None]],
        handler: AsyncHandler[Any, R],
        groups: Sequence[Hashable] | None,
        concurrency: int,
        stop: Callable[[Hashable], bool] | None,
        started: float,
        *,
        settled: Early[R] | None = None,
        slots: Semaphore | None = None,
    ) -> list[Handled[R]]:
        self._refuse_async(handler)
        if concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if groups is not None and len(groups) != len(entries):
            raise ConfigurationError(
                f"{len(groups)} groups for {len(entries)} items: give one group per item"
            )
        results: list[Handled[R] | None] = [None] * len(entries)
        runs, copies = await self._claim_batch(entries, groups, results, started)
        # Every claim the batch holds, renewed until it is completed or released: one that
        # waits behind its group, or whose handler returned while others still run, would
        # otherwise lapse in a batch that outlasts the lease, and another worker's copy would
        # take it over and run it again.
        held, beat = self._renewing(runs)
        batch = _BatchRun(
            self, entries, handler, stop, started, results, held, len(runs), groups is not None
        )
        if ASYNC:  # noqa: SIM102 - the sync twin keeps no early reports
            if settled is not None and len(runs) > 1:
                batch.early = Gather(functools.partial(batch.report, settled))
        try:
            await self._run_groups(runs, batch.run, concurrency, batch.finished, slots)
            if ASYNC:  # noqa: SIM102 - the sync twin keeps no early reports
                if batch.early is not None:
                    await batch.early.settle()
            await batch.complete(list(batch.finished))
        finally:
            if ASYNC:  # noqa: SIM102 - the sync twin keeps no early reports
                if batch.early is not None:
                    await batch.early.close()
            held.clear()
            if beat is not None:
                await beat.stop()
        for i, (first, claim) in copies.items():
            # A copy of a message earlier in this batch (a producer's retry in the same poll):
            # once that one completed, the copy is its duplicate now, rather than in_flight
            # and given back to stall its partition or queue until a redelivery says so.
            found = batch.completed.get(first)
            step = Step.DUPLICATE if found is not None else Step.IN_FLIGHT
            decided = found if found is not None else claim
            results[i] = self._rules.settle(step, decided, entries[i][2], started)
        return [handled for handled in results if handled is not None]

    async def _run_groups(
        self,
        runs: dict[Hashable, list[tuple[int, Claim, Step]]],
        run: Callable[[Hashable, list[tuple[int, Claim, Step]]], Awaitable[None]],
        concurrency: int,
        finished: list[tuple[int, Claim, Any, bytes | None, str | None]],
        shared: Semaphore | None = None,
    ) -> None:
        """Run a batch's groups, up to ``concurrency`` at once (or as ``shared`` allows)."""
        if ASYNC:
            slots = shared if shared is not None else Semaphore(concurrency)

            async def bounded(group: Hashable, members: list[tuple[int, Claim, Step]]) -> None:
                async with slots:
                    await run(group, members)

            tasks = [create_task(bounded(group, members)) for group, members in runs.items()]
            try:
                await gather(*tasks)
            except BaseException:
                # Cancelled (a shutdown's grace ran out; gather passed the cancel on to every
                # group's task): each is waited for, as it may still be releasing its claim
                # (gather stops at the first one to end, and a second cancel would cut that
                # release short), then the handlers that did finish keep their results, so a
                # redelivery is their duplicate rather than a second run.
                await wait(tasks)
                with contextlib.suppress(Exception):
                    await self._complete_many(_completions(finished))
                raise
        else:
            for group, members in runs.items():
                run(group, members)

    def _renewing(
        self, runs: dict[Hashable, list[tuple[int, Claim, Step]]]
    ) -> tuple[dict[int, Record], AsyncTicket | None]:
        """The claims a batch won (by index), and a heartbeat that renews each of them still
        in that mapping at each beat (None when the lease has no heartbeat): the batch takes
        a claim out once it released it."""
        held = {
            i: claim.record
            for members in runs.values()
            for i, claim, step in members
            if step is Step.PROCEED
        }
        if not self._lease.heartbeat or not held:
            return held, None

        async def renew_held() -> None:
            for record in list(held.values()):
                await self._renew(record.key, record.token)

        return held, self._heartbeats.start(renew_held, self._renew_every)

    async def _claim_batch(
        self,
        entries: Sequence[tuple[str | Handled[R], Any, str | None]],
        groups: Sequence[Hashable] | None,
        results: list[Handled[R] | None],
        started: float,
    ) -> tuple[dict[Hashable, list[tuple[int, Claim, Step]]], dict[int, tuple[int, Claim]]]:
        """Claim the batch's admitted keys in one round trip; fill in ``results`` for the
        items decided without running (refused, duplicate, in flight...) and return the won
        claims by group, in order, and the copies of an item this batch won (by index: the
        index of the item they copy, and their own claim), decided once that item is."""
        claimed: list[int] = []
        requests: list[ClaimRequest] = []
        for i, (key, payload, correlation_id) in enumerate(entries):
            admitted = (
                key
                if isinstance(key, Handled)
                else self._rules.admit(key, payload, started, correlation_id)
            )
            if isinstance(admitted, Handled):
                results[i] = admitted
            else:
                claimed.append(i)
                requests.append(ClaimRequest(admitted[0], admitted[1], new_token()))
        claims = (
            await self._store.claim_many(
                self._consumer,
                requests,
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
                takeover=self._takeover,
            )
            if requests
            else []
        )
        runs: dict[Hashable, list[tuple[int, Claim, Step]]] = {}
        won: dict[str, int] = {}
        copies: dict[int, tuple[int, Claim]] = {}
        blocked: dict[Hashable, str] = {}
        """Groups whose message met its key held elsewhere: it is given back, and the later
        ones of its group wait behind it (a group is an order: a FIFO group, a partition)."""
        for i, request, claim in zip(claimed, requests, claims, strict=True):
            step = decide(claim, request.fingerprint)
            group = None if groups is None else groups[i]
            if (step is Step.PROCEED or step is Step.STALE) and group in blocked:
                if claim.won:
                    await self._release_quietly(claim.record.key, claim.record.token)
                results[i] = self._rules.done(
                    Outcome.IN_FLIGHT,
                    claim.record.key,
                    started,
                    reason=blocked[group],
                    attempt=claim.record.attempt,
                    correlation_id=entries[i][2],
                )
            elif step is Step.PROCEED or step is Step.STALE:
                runs.setdefault(group, []).append((i, claim, step))
                if claim.won:
                    won[claim.record.token] = i
            elif step is Step.IN_FLIGHT and claim.record.token in won:
                copies[i] = (won[claim.record.token], claim)  # held by this very batch
            else:
                results[i] = self._rules.settle(step, claim, entries[i][2], started)
                if step is Step.IN_FLIGHT and groups is not None:
                    blocked.setdefault(
                        group,
                        "held back: the earlier message with key "
                        f"{self._rules.shown(claim.record.key)} of its group is held elsewhere, "
                        "and the group's order is kept",
                    )
        return runs, copies

    async def _complete_many(self, completions: list[Completion]) -> list[Record | LeaseLost]:
        # As _complete: the effects are done, so a short outage is ridden out.
        store = self._store
        first = perf_counter()
        for pause in _COMPLETE_PAUSES:
            try:
                if isinstance(store, AsyncCompletesMany):
                    return await store.complete_many(
                        self._consumer, completions, keep_ms=self._keep_ms
                    )
                return await complete_each(
                    store, self._consumer, completions, keep_ms=self._keep_ms
                )
            except StoreUnavailable:
                if not _retry_complete(first, pause):
                    raise
                assert pause is not None
                await sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    async def handle_message(
        self,
        envelope: Envelope,
        handler: AsyncHandler[object, R],
        *,
        key: KeySource | None = None,
        wait: timedelta | None = None,
    ) -> Handled[R]:
        """:meth:`handle` for a broker message: the key comes from ``key`` (default: the
        producer's message id). A message without a usable key is ``rejected`` with the reason
        (dead-lettered by adapters), never processed unprotected (R2-R4)."""
        found: str | Handled[R] = self._rules.message_key(envelope, key, perf_counter())
        if isinstance(found, Handled):
            return found
        # A message's duplicate is acknowledged, its value read by no one: it is not
        # converted (a stored form the annotation refuses must not hold the message back).
        return await self.handle(
            found,
            envelope.body,
            handler,
            correlation_id=envelope.correlation_id,
            wait=wait,
            returns=None,
        )

    def idempotent(
        self,
        *,
        key: Callable[..., str],
        wait: timedelta | None = timedelta(seconds=10),
        returns: Any = ANNOTATED,
        scope: str | None = None,
    ) -> Callable[[AsyncFunction[PS, R]], AsyncFunction[PS, R]]:
        """Decorate a function so each key runs once; repeats return the first result.

        ``key`` receives the function's arguments and returns the idempotency key; the bound
        arguments are the payload that is fingerprinted, so the same key with other arguments
        raises :class:`~oncely.KeyConflict`. A key belongs to one function: the function's
        ``scope`` (default: ``module.qualname``) is part of the fingerprint its records keep,
        whatever the inbox's ``fingerprint``, so another function reaching the same key (with
        the same arguments or not) raises :class:`~oncely.KeyConflict` too and does not run,
        never returning this one's result. A function renamed or moved keeps the keys it
        recorded before with ``scope="its.old.name"``. A call that finds the key in flight
        waits up to ``wait`` for it, then raises :class:`~oncely.InFlight`. A raising
        function releases the key and its exception propagates unchanged.

        A repeat returns the first result as the type the function returns (its return
        annotation, or ``returns=``): a dataclass, a pydantic model, a ``datetime``, a
        ``Decimal``, lists and dicts of them, rebuilt from the stored form (``returns=None``:
        the stored form as it is decoded). In a union, a stored value that already is one of
        its members (a string, a number) stays as it is. A function with no return annotation
        whose result a repeat would get back as another type (``bytes`` as base64 text, a
        dataclass as a dict) is warned about once, at the first such result. A repeat whose
        first result was not kept (over ``max_result_bytes``, or not encodable) raises
        :class:`~oncely.ResultUnavailable`, never returns ``None`` for it. On a method, the
        instance (``self``, or ``cls``) is not part of the fingerprinted payload.
        """
        if scope is not None and (not isinstance(scope, str) or not scope.strip()):
            raise ConfigurationError(
                f"scope is the name a function's keys are recorded under, a non-empty string "
                f"(the function's earlier module.qualname, to keep its keys), not {scope!r}"
            )

        def decorate(fn: AsyncFunction[PS, R]) -> AsyncFunction[PS, R]:
            if ASYNC:
                if not inspect.iscoroutinefunction(fn):
                    raise TypeError(
                        f"AsyncInbox.idempotent decorates an async def; {function_name(fn)} is "
                        "a plain function: decorate it with a sync oncely.Inbox's idempotent"
                    )
            else:
                refuse_async(fn)
            signature = inspect.signature(fn)
            instance = _instance_parameter(signature)
            made = _Decorated(fn, scope or function_name(fn, qualified=True), returns, self._rules)

            @functools.wraps(fn)
            async def once(*args: PS.args, **kwargs: PS.kwargs) -> R:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                payload = dict(bound.arguments)
                if instance is not None:
                    payload.pop(instance)  # a method's self (or cls) is not what it is given

                async def run(_payload: object) -> R:
                    return await fn(*args, **kwargs)

                handled = await self._call(key(*args, **kwargs), payload, run, wait, made.scope)
                return cast(R, made.returned(handled))

            return once

        return decorate

    async def _call(
        self,
        key: str,
        payload: object,
        run: AsyncHandler[object, R],
        wait: timedelta | None,
        scope: str,
    ) -> Handled[R]:
        """:meth:`handle` for an ``@idempotent`` function, whose ``scope`` is part of the
        fingerprint; a duplicate's value is left as stored (converted by the decorator)."""
        started = perf_counter()
        correlation_id = outer_correlation_id()
        got = await self._acquire(key, payload, correlation_id, wait, started, scope)
        if isinstance(got, Claim):
            return await self._run(got, payload, run, correlation_id, started)
        return got

    # ------------------------------------------------------------------------ records

    async def get(self, key: str) -> Record | None:
        """This consumer's unexpired record for ``key``."""
        return await self._store.get(self._consumer, validate_key(key, self._limits))

    async def forget(self, key: str) -> bool:
        """Delete this consumer's record for ``key`` (an operator's decision: the next delivery
        is processed again). True if there was one."""
        return await self._store.forget(self._consumer, validate_key(key, self._limits))

    # ------------------------------------------------------------------ operations

    async def resolve(
        self, key: str, resolution: Resolution, *, note: str | None = None
    ) -> Resolved:
        """Settle ``key``'s record by an operator's decision, with no redelivery needed: an
        escalated or stuck claim, a poison message fixed by hand.

        ``Resolution.completed(result)`` records the effect as done (its deliveries are then
        duplicates answered with ``result``); ``Resolution.failed(reason)`` records a poison
        message (its deliveries are rejected); ``Resolution.retry()`` deletes the record so the
        next delivery runs the handler. Every write is fenced: an in-progress record is first
        taken over, which the store refuses while its lease is live, so a running worker is
        never overridden; a settled record is deleted only while it is the one read, by its
        token (a store without ``forget_by_token``, a plugin's, deletes it unfenced). ``note``
        is kept on a completed record (default: that an operator resolved it). The settled
        record is kept for this inbox's retention, never for less than the record's own
        (R13). Raises :class:`~oncely.ResolveRefused`, changing nothing, when a live claim
        holds the record (or took it meanwhile), the record is already settled that way (or
        completed: forget it to run it again), or there is nothing to retry.
        """
        return await self._resolve(key, resolution, note, "an operator")

    async def _resolve(
        self, key: str, resolution: Resolution, note: str | None, by: str
    ) -> Resolved:
        """:meth:`resolve`, the decision made ``by`` an operator or the reconciler (said in
        the record's note or reason and in what is returned)."""
        checked = validate_key(key, self._limits)
        action = resolution.action
        if action not in ("completed", "failed", "retry"):
            raise ConfigurationError(
                "resolve takes Resolution.completed(result), Resolution.failed(reason) or "
                f"Resolution.retry(), not {action!r}"
            )
        data = self._rules.encode(resolution.result, strict=True)[0]
        before = await self._store.get(self._consumer, checked)
        keep_ms, keep_failed_ms = _kept(before, self._keep_ms, self._keep_failed_ms)
        record = before
        # The fingerprint of the content first delivered: kept on the settled record even
        # when a failed one is deleted and written afresh, so the key reused for other
        # content is still a key conflict, never a duplicate (R20 step 6).
        fingerprint = None if before is None else before.fingerprint
        token: str | None = None
        for _ in range(_MAX_ROUNDS):
            token, record = await self._own(checked, record, action, keep_ms, fingerprint)
            if record is not None and record.fingerprint is not None:
                fingerprint = record.fingerprint
            if token is not None:
                break
        if token is None:
            raise StoreUnavailable(f"the record of {checked!r} kept changing; try again later")
        try:
            if action == "retry":
                if record is not None:  # a failed record, deleted as an operator's decision
                    await self._forget_seen(checked, record)
                else:
                    await self._store.release(self._consumer, checked, token=token)
                return Resolved(checked, action, before, None, "deleted: the next delivery runs")
            if action == "completed":
                after = await self._store.complete(
                    self._consumer,
                    checked,
                    token=token,
                    result=data,
                    keep_ms=keep_ms,
                    note=note or f"resolved as completed by {by}",
                )
            else:
                reason = resolution.reason or f"resolved as failed by {by}"
                after = await self._store.fail(
                    self._consumer,
                    checked,
                    token=token,
                    error=reason[: self._limits.max_error_chars],
                    keep_ms=keep_failed_ms,
                )
        except LeaseLost as lost:  # our own fresh claim, taken over already: not ours to settle
            raise ResolveRefused(
                f"{checked!r} changed hands while it was being resolved: {lost_reason(lost)}",
                lost.current,
            ) from None
        return Resolved(checked, action, before, after, f"{action} by {by}")

    async def _own(
        self,
        key: str,
        record: Record | None,
        action: str,
        keep_ms: int,
        fingerprint: str | None,
    ) -> tuple[str | None, Record | None]:
        """A token that owns ``key``'s record (taken over, or claimed afresh with
        ``fingerprint``, kept ``keep_ms``), or ``(None, record now)`` to decide again. A
        failed record asked to retry is owned as it is (``(token, record)``: it is deleted by
        an operator's decision)."""
        token = new_token()
        if record is None:
            if action == "retry":
                raise ResolveRefused(
                    f"{key!r} has no record: there is nothing to retry (its next delivery "
                    "runs the handler)",
                    None,
                )
            claim = await self._store.claim(
                self._consumer,
                key,
                fingerprint=fingerprint,
                token=token,
                lease_ms=self._lease_ms,
                keep_ms=keep_ms,
                takeover=False,
            )
            return (token, None) if claim.won else (None, claim.record)
        if record.status is Status.IN_PROGRESS:
            claim = await self._store.takeover(
                self._consumer,
                key,
                expected_token=record.token,
                fingerprint=record.fingerprint,
                token=token,
                lease_ms=self._lease_ms,
                keep_ms=keep_ms,
            )
            if claim.won:
                return token, None
            current = claim.record
            if current.status is Status.IN_PROGRESS and current.token == record.token:
                raise ResolveRefused(
                    f"{key!r} is held by a live claim (attempt {current.attempt}, lease until "
                    f"{current.lease_until.isoformat(timespec='milliseconds')}); resolve never "
                    "overrides a running worker: let its lease lapse (stop it) and resolve again",
                    current,
                )
            return None, current  # settled or taken over meanwhile: decide on what it is now
        if record.status is Status.COMPLETED:
            raise ResolveRefused(
                f"{key!r} is already completed; to have its next delivery run the handler "
                "again, forget it (oncely inbox forget)",
                record,
            )
        if action == "failed":
            raise ResolveRefused(f"{key!r} is already failed: {record.error}", record)
        # A failed record: terminal, no worker writes it again. Delete it, then (completed)
        # claim the key afresh; a delivery that claims it first in between wins.
        if action == "retry":
            return token, record
        try:
            await self._forget_seen(key, record)
        except ResolveRefused as refused:  # claimed afresh meanwhile: decide on what it is now
            return None, refused.current
        return None, None

    async def _forget_seen(self, key: str, seen: Record) -> None:
        """Delete ``seen`` (a settled record read before) only while it is that record: it
        may have expired, or been forgotten, and been claimed afresh by a delivery whose
        worker runs the handler now. :class:`~oncely.ResolveRefused` when it changed. A
        store without :class:`AsyncForgetsByToken` (a plugin's) deletes it unfenced."""
        store = self._store
        if not isinstance(store, AsyncForgetsByToken):
            await store.forget(self._consumer, key)
            return
        try:
            await store.forget_by_token(self._consumer, key, token=seen.token)
        except LeaseLost as lost:
            now = lost.current
            state = "absent" if now is None else f"{now.status}, attempt {now.attempt}"
            if now is not None and now.status is Status.IN_PROGRESS:
                state += ", a live claim: a worker may be running its handler"
            raise ResolveRefused(
                f"{key!r} changed while it was being resolved (now {state}); nothing was "
                "deleted: look at it again",
                now,
            ) from None

    async def stale_claims(self, *, limit: int | None = None, page: int = 100) -> list[Record]:
        """This consumer's in-progress records whose lease has lapsed by this process's clock
        (their worker died or stalled), in key order, reading ``page`` records at a time; at
        most ``limit``. What :meth:`reconcile` works on; reading them changes nothing."""
        found: list[Record] = []
        after: tuple[str, str] | None = None
        while limit is None or len(found) < limit:
            records = await self._store.scan(
                consumer=self._consumer, status=Status.IN_PROGRESS, after=after, limit=page
            )
            if not records:
                break
            after = (records[-1].consumer, records[-1].key)
            now = int(time() * 1000)
            found.extend(record for record in records if record.is_stale(now))
        return found if limit is None else found[:limit]

    async def reconcile(self, *, limit: int | None = None, page: int = 100) -> list[Resolved]:
        """Apply this inbox's ``on_stale`` policy now to its stale in-progress records
        (:meth:`stale_claims`), instead of when each message happens to be redelivered (R10).

        A reconciler is asked about each (``StaleClaim.payload`` is ``None``: there is no
        delivery); with ``on_stale="retry"`` each is deleted so its next delivery runs the
        handler, with ``"escalate"`` each is left for a person and reported. Every write is
        fenced by a takeover the store refuses while the lease is live (by the store's clock),
        so a worker that came back keeps its claim (``skipped``). Returns what happened to
        each.
        """
        return [
            await self._reconcile_one(record)
            for record in await self.stale_claims(limit=limit, page=page)
        ]

    async def _reconcile_one(self, record: Record) -> Resolved:
        key = record.key
        if self._reconciler is None:
            resolution = (
                Resolution.retry()
                if self._takeover
                else Resolution.escalate("on_stale=escalate: left for a person")
            )
        else:
            try:
                resolution = await self._reconciler(StaleClaim(record, None))
            except Exception as exc:
                return Resolved(key, "error", record, record, f"reconciler raised {said(exc)}")
            if not isinstance(resolution, Resolution):  # typed, but a user's function
                return Resolved(  # type: ignore[unreachable]
                    key,
                    "error",
                    record,
                    record,
                    f"the reconciler returned {type(resolution).__name__}, not an "
                    "oncely.Resolution (Resolution.completed(...), .failed(...), .retry() or "
                    ".escalate(...)); nothing was changed",
                )
        if resolution.action == "escalate":
            return Resolved(key, "escalate", record, record, resolution.reason or "escalated")
        by = "the reconciler" if self._reconciler is not None else "on_stale=retry"
        try:
            return await self._resolve(
                key,
                resolution,
                resolution.reason or "reconciled: the external system showed it done",
                by,
            )
        except ResolveRefused as refused:
            return Resolved(key, "skipped", record, refused.current, str(refused))
        except (InvalidKey, PayloadError) as refused:  # this claim's, not the run's
            return Resolved(key, "error", record, record, str(refused))

    async def prepare(self) -> None:
        """Connect to the store and check its schema now (creating it when the store was
        opened with ``migrate=True``), instead of at the first message: a store that is down
        raises :class:`~oncely.StoreUnavailable` here, a schema this oncely cannot use a
        :class:`~oncely.SchemaError`. A consumer calls it at start; a store without
        ``prepare`` is left to its first operation."""
        if isinstance(self.store, AsyncPrepares):
            await self.store.prepare()

    async def aclose(self) -> None:
        """Stop background heartbeats. The store stays open (it is yours)."""
        self._heartbeats.close()

    async def __aenter__(self) -> Self:
        """As a context manager (``async with``; ``with`` for the sync inbox) the inbox is
        closed at the end of the block; the store is not (it is yours)."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ two-phase mode (R10)

    async def handle(
        self,
        key: str,
        payload: P,
        handler: AsyncHandler[P, R],
        *,
        correlation_id: str | None = None,
        wait: timedelta | None = None,
        returns: Any = ANNOTATED,
    ) -> Handled[R]:
        """Run ``handler(payload)`` unless ``key`` was processed before (two-phase mode).

        Returns ``processed`` (or ``stale_reclaimed``) with the handler's result, ``duplicate``
        with the result stored the first time, ``in_flight`` while another worker holds a live
        claim, ``key_conflict`` when the key was used for other content, ``escalated`` when a
        lapsed claim needs a person, ``failed`` when the handler raised (the claim is released
        so a redelivery retries) and ``rejected`` for a bad key or a poison message (the handler
        raised :class:`~oncely.Reject`, or did so for this key before).

        With ``wait``, a caller that is not a broker waits up to that long for an in-flight
        claim to finish and receives its result (or takes over its work if it is released).

        Without ``correlation_id``, a call made inside another handler (an ``@idempotent``
        function that handler calls) is logged with that handler's message's (R16).

        A ``duplicate``'s value is the first result as the type ``handler`` returns (its
        return annotation, or ``returns=``; ``None``: the stored form as decoded), as
        :meth:`idempotent` does; :class:`~oncely.PayloadError` when it cannot be read back so.
        """
        self._refuse_async(handler)
        started = perf_counter()
        if correlation_id is None:
            correlation_id = outer_correlation_id()
        got = await self._acquire(key, payload, correlation_id, wait, started)
        if isinstance(got, Claim):
            return await self._run(got, payload, handler, correlation_id, started)
        return typed_repeat(got, handler, returns)

    async def claim(
        self,
        key: str,
        payload: object = None,
        *,
        correlation_id: str | None = None,
        wait: timedelta | None = None,
    ) -> AsyncClaimed[Any]:
        """Claim ``key`` for work done outside a handler (an HTTP response streamed to the
        client, a job runner's step): :meth:`handle` without the handler.

        When the returned :class:`AsyncClaimed` is ``won``, the caller does the work and ends
        it with ``complete(result)``, ``release()`` (give it back: the next caller runs it) or
        ``reject(reason)`` (poison: recorded, never run again); the lease is renewed in the
        background meanwhile (or by ``renew()`` with ``Lease(heartbeat=False)``), and every
        ending is fenced by the claim's token. When it is not won, ``handled`` is the outcome
        that :meth:`handle` would have returned without running anything: ``duplicate`` with
        the stored result, ``in_flight``, ``key_conflict``, ``rejected``, ``escalated``.
        As an ``async with`` block, a block that raises gives the claim back (a
        :class:`~oncely.Reject` rejects it), and one that ends without an ending releases it.
        Without ``correlation_id``, one made inside a handler takes its message's."""
        started = perf_counter()
        if correlation_id is None:
            correlation_id = outer_correlation_id()
        got = await self._acquire(key, payload, correlation_id, wait, started)
        if isinstance(got, Claim):
            return AsyncClaimed(self, got, correlation_id, started)
        return AsyncClaimed(self, None, correlation_id, started, got)

    async def _acquire(
        self,
        key: str,
        payload: object,
        correlation_id: str | None,
        wait: timedelta | None,
        started: float,
        scope: str | None = None,
    ) -> Claim | Handled[Any]:
        """The claim to proceed under (won, or taken over from a lapsed one), or the outcome
        when there is nothing to run. ``scope`` (an ``@idempotent`` function's) is mixed into
        the fingerprint, whatever the inbox's strategy, so another function's record of the
        same key is a key conflict."""
        try:
            checked = validate_key(key, self._limits)
            fp = self._fingerprint(payload)
            if scope is not None:
                fp = scoped(scope, fp)
        except Exception as exc:
            return self._rules.refused(key, exc, started, correlation_id)
        deadline = None if wait is None else started + wait.total_seconds()
        pause = 0.005
        store = self._store
        rounds = 0
        while rounds < _MAX_ROUNDS:
            claim = await store.claim(
                self._consumer,
                checked,
                fingerprint=fp,
                token=new_token(),
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
                takeover=self._takeover,
            )
            step = decide(claim, fp)
            if step is Step.PROCEED:
                return claim
            if step is Step.STALE:
                got = await self._stale(claim, fp, payload, correlation_id, started)
                if got is not None:
                    return got
                rounds += 1
                continue
            if step is Step.IN_FLIGHT and deadline is not None:
                remaining = deadline - perf_counter()
                if remaining > 0:
                    await sleep(min(pause, remaining))
                    pause = min(pause * 2, 0.25)
                    continue
            return self._rules.settle(step, claim, correlation_id, started)
        raise StoreUnavailable(f"claim for key {checked!r} kept changing hands; try again later")

    async def _run(
        self,
        claim: Claim,
        payload: P,
        handler: AsyncHandler[P, R],
        correlation_id: str | None,
        started: float,
    ) -> Handled[R]:
        record = claim.record
        result, error = await self._invoke(claim, payload, handler, correlation_id)
        if error is not None:
            return await self._raised(record, error, correlation_id, started)
        return await self._finish(claim, result, correlation_id, started)

    async def _finish(
        self,
        claim: Claim,
        result: R | None,
        correlation_id: str | None,
        started: float,
        not_kept: str | None = None,
    ) -> Handled[R]:
        """Complete ``claim`` with ``result`` (fenced), or without one for the reason
        ``not_kept``, and say what came of it."""
        record = claim.record
        if not_kept is not None:
            data, note = None, not_kept_note(not_kept)
        elif result is None:
            data, note = None, None
        else:
            data, note = self._rules.encode(result, strict=False)
        done: Record | LeaseLost
        try:
            done = await self._complete(record.key, record.token, data, note)
        except LeaseLost as lost:
            done = lost
        return self._outcome(claim, result, note, done, correlation_id, started)

    async def _invoke(
        self, claim: Claim, payload: P, handler: AsyncHandler[P, R], correlation_id: str | None
    ) -> tuple[R | None, BaseException | None]:
        """Run the handler under the claim (its heartbeat renewing the lease): its result, or
        what it raised."""
        record = claim.record
        key = record.key
        beat = None
        if self._lease.heartbeat:
            beat = self._heartbeats.start(
                functools.partial(self._renew, key, record.token), self._renew_every
            )
        context = _CURRENT.set((self._consumer, key, record.attempt, correlation_id, "two_phase"))
        try:
            if ASYNC:
                returned: Any = handler(payload)
                if isawaitable(returned):
                    return await returned, None
                # A plain function ran already: its value is the result (not a generator,
                # whose body has not run).
                refuse_unrun(returned, handler)
                return returned, None
            else:
                return sync_result(handler(payload), handler), None
        except BaseException as exc:
            return None, exc
        finally:
            _CURRENT.reset(context)
            if beat is not None:
                await beat.stop()

    async def _raised(
        self, record: Record, error: BaseException, correlation_id: str | None, started: float
    ) -> Handled[R]:
        """The outcome of a handler that raised ``error`` under ``record``'s claim."""
        if isinstance(error, HandlerRefused):  # it never ran: nothing to record
            await self._release_quietly(record.key, record.token)
            raise error
        if isinstance(error, Reject):
            return await self._reject(record, error.reason, correlation_id, started)
        await self._release_quietly(record.key, record.token)
        if not isinstance(error, Exception):
            raise error
        # The record itself was released: the outcome reports the attempt, not the record.
        return self._rules.failed(record.key, error, started, correlation_id, record.attempt)

    def _outcome(
        self,
        claim: Claim,
        result: R | None,
        note: str | None,
        done: Record | LeaseLost,
        correlation_id: str | None,
        started: float,
    ) -> Handled[R]:
        """The outcome of a handler that returned ``result``, once its completion is ``done``."""
        key = claim.record.key
        if isinstance(done, LeaseLost):
            return self._rules.lost(done, key, claim.record.attempt, correlation_id, started)
        if claim.status is ClaimStatus.TAKEN_OVER:
            return self._rules.done(
                Outcome.STALE_RECLAIMED,
                key,
                started,
                value=result,
                reason=note or reclaim_reason(claim),
                record=done,
                correlation_id=correlation_id,
            )
        if note is not None:
            return self._rules.done(
                Outcome.PROCESSED,
                key,
                started,
                value=result,
                reason=note,
                record=done,
                correlation_id=correlation_id,
            )
        return self._rules.processed(key, started, result, done, correlation_id)

    async def _complete(self, key: str, token: str, data: bytes | None, note: str | None) -> Record:
        # The effects are done: losing the completion would let a redelivery repeat them, so
        # a short outage is ridden out (complete is idempotent for the same token), for about
        # a second (_COMPLETE_WITHIN) however long each try waits on the store's timeouts.
        first = perf_counter()
        for pause in _COMPLETE_PAUSES:
            try:
                return await self._store.complete(
                    self._consumer, key, token=token, result=data, keep_ms=self._keep_ms, note=note
                )
            except StoreUnavailable:
                if not _retry_complete(first, pause):
                    raise
                assert pause is not None
                await sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _renew(self, key: str, token: str) -> None:
        try:
            await self._store.renew(
                self._consumer, key, token=token, lease_ms=self._lease_ms, keep_ms=self._keep_ms
            )
        except LeaseLost as lost:
            self._rules.observer.logger.warning(
                "oncely lease lost consumer=%s key=%s: %s",
                self._consumer, self._shown(key), lost_reason(lost),
            )  # fmt: skip
        except Exception as exc:
            self._rules.observer.logger.warning(
                "oncely could not renew the lease consumer=%s key=%s: %s",
                self._consumer, self._shown(key), self._redacted(exc, key),
            )  # fmt: skip

    def _shown(self, key: str) -> str:
        """``key`` as this inbox's log lines show keys (``log_keys``), escaped for a line."""
        return printable(key_for_logs(key, self._rules.observer.log_keys) or "")

    def _redacted(self, exc: BaseException, key: str) -> str:
        """``exc``'s text for a log line, ``key`` in it shown as the lines show keys."""
        return printable(redact_keys(str(exc), (key,), self._rules.observer.log_keys))

    async def _release_quietly(self, key: str, token: str) -> None:
        try:
            await self._store.release(self._consumer, key, token=token)
        except LeaseLost:
            pass  # another worker owns the key now; nothing of ours to release
        except StoreError as exc:
            self._rules.observer.logger.warning(
                "oncely could not release the claim consumer=%s key=%s (%s); a redelivery "
                "retries once the lease lapses",
                self._consumer,
                self._shown(key),
                self._redacted(exc, key),
            )

    async def _reject(
        self, record: Record, reason: str, correlation_id: str | None, started: float
    ) -> Handled[R]:
        key = record.key
        try:
            done = await self._store.fail(
                self._consumer,
                key,
                token=record.token,
                error=reason[: self._limits.max_error_chars],
                keep_ms=self._keep_failed_ms,
            )
        except LeaseLost as lost:
            return self._rules.lost(lost, key, record.attempt, correlation_id, started)
        return self._rules.rejected(key, reason, started, correlation_id, done)

    async def _stale(
        self,
        claim: Claim,
        fp: str | None,
        payload: object,
        correlation_id: str | None,
        started: float,
    ) -> Claim | Handled[Any] | None:
        """Apply ``on_stale`` to a lapsed claim: the claim taken over (run the work under it),
        an outcome, or None (the record moved on; decide again)."""
        record = claim.record
        key = record.key
        if self._reconciler is None:
            return self._rules.settle(Step.STALE, claim, correlation_id, started)
        try:
            resolution = await self._reconciler(StaleClaim(record, payload))
        except Exception as exc:
            return self._rules.done(
                Outcome.FAILED,
                key,
                started,
                reason=f"reconciler raised {said(exc)}",
                error=exc,
                record=record,
                correlation_id=correlation_id,
            )
        if resolution.action == "retry":
            taken = await self._store.takeover(
                self._consumer,
                key,
                expected_token=record.token,
                fingerprint=fp,
                token=new_token(),
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
            )
            return taken if taken.won else None
        if resolution.action == "completed":
            data, note = self._rules.encode(resolution.result, strict=False)
            try:
                done = await self._store.complete(
                    self._consumer,
                    key,
                    token=record.token,
                    result=data,
                    keep_ms=self._keep_ms,
                    note=note or "reconciled: the external system showed the effect done",
                )
            except LeaseLost:
                return None
            return self._rules.done(
                Outcome.DUPLICATE,
                key,
                started,
                value=resolution.result,
                record=done,
                reason="stale claim reconciled as completed",
                correlation_id=correlation_id,
            )
        if resolution.action == "failed":  # the external system shows it failed for good
            reason = resolution.reason or "the reconciler found the message failed for good"
            return await self._reject(record, reason, correlation_id, started)
        return self._rules.done(
            Outcome.ESCALATED,
            key,
            started,
            reason=resolution.reason or "the reconciler escalated the stale claim",
            record=record,
            correlation_id=correlation_id,
        )

    # ------------------------------------------------------------------ transactional mode (R7)

    async def handle_in_transaction(
        self,
        key: str,
        payload: P,
        handler: AsyncTxHandler[Tx, P, R],
        *,
        tx: Tx | None = None,
        savepoint: bool = True,
        correlation_id: str | None = None,
        returns: Any = ANNOTATED,
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

        Outcomes (and a ``duplicate``'s typed value, ``returns=``) are those of
        :meth:`handle`; ``failed`` means the handler raised and its
        writes were rolled back with the marker, so a redelivery retries; in oncely's own
        transaction, so does a COMMIT that a constraint checked at commit refused
        (:class:`~oncely.CommitRefused`). A result that cannot be stored also fails the
        transaction (nothing happened, so nothing is lost). On DynamoDB, whose claim is
        checked at the commit, a commit refused because another worker recorded the key
        meanwhile (:class:`~oncely.KeyTaken`: nothing was written) is followed by one more
        claim in a new transaction, and the winner's record answers (``duplicate``,
        ``in_flight``).
        """
        self._refuse_async(handler)
        started = perf_counter()
        correlation_id = correlation_id if correlation_id is not None else outer_correlation_id()
        try:
            checked = validate_key(key, self._limits)
            fp = self._fingerprint(payload)
        except Exception as exc:
            return self._rules.refused(key, exc, started, correlation_id)
        store: AsyncTransactionalStore[Tx] | None = self._tx_store
        if store is None:
            raise TransactionsUnsupported(
                f"{type(self._store).__name__} cannot join a transaction; use the two-phase "
                "mode (Inbox.handle) for it, or a SQL or DynamoDB store for the transactional mode"
            )
        consumer = self._consumer
        if tx is not None:
            await _joinable(store, tx)
        # A commit refused because another worker recorded the key first (KeyTaken: a store
        # that checks the claim at the commit, DynamoDB) wrote nothing: the key is claimed
        # again, once, in a new transaction, and the winner's record answers.
        for again in (True, False):
            token = new_token()
            # One body for the three ways in: oncely's own transaction, a savepoint in the
            # caller's, or the caller's transaction as it is.
            block: AbstractAsyncContextManager[Any]
            if tx is None:
                block = store.transaction(claim_first=True)  # the claim is the first statement
            else:
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
                            value = await _called_in(store, handler, conn, payload)
                            data = (
                                None if value is None else self._rules.encode(value, strict=True)[0]
                            )
                        except (HandlerRefused, TransactionEnded):
                            raise  # the transaction rolls back (or was ended): nothing recorded
                        except Exception as exc:
                            raise _HandlerError(exc) from exc
                        finally:
                            _CURRENT.reset(context)
                        await _keep_result(store, conn, consumer, checked, token, data)
                        if data is not None:
                            record = with_result(record, data)
            except (_HandlerError, CommitRefused) as failure:
                if isinstance(failure, KeyTaken) and tx is None and again:
                    continue
                return await self._failed_in(
                    store, tx, savepoint, failure, checked, fp, started, correlation_id, record
                )
            break
        return self._settled_in(
            step, claim, checked, started, value, record, correlation_id, handler, returns
        )

    async def _failed_in(
        self,
        store: AsyncTransactionalStore[Tx],
        tx: Tx | None,
        savepoint: bool,
        failure: Exception,
        key: str,
        fp: str | None,
        started: float,
        correlation_id: str | None,
        record: Record,
    ) -> Handled[Any]:
        """The outcome of a transaction that the handler failed (or rejected), or whose
        COMMIT refused the handler's writes (:class:`~oncely.CommitRefused`: a deferred
        constraint they broke, a DynamoDB condition of theirs), so that nothing committed, the
        marker neither: the handler's failure, retried and dead-lettered as one, not a store
        outage. Without a savepoint in a caller's transaction, the error reaches the caller."""
        error = failure.error if isinstance(failure, _HandlerError) else failure
        if tx is not None and not savepoint:
            raise error from None  # the caller's transaction rolls back
        if isinstance(error, Reject):
            await self._reject_in(store, tx, key, fp, error.reason)
            return self._rules.rejected(key, error.reason, started, correlation_id)
        # The attempt this was (the claim that counted it was rolled back with the rest).
        return self._rules.failed(key, error, started, correlation_id, record.attempt)

    def _settled_in(
        self,
        step: Step,
        claim: Claim,
        key: str,
        started: float,
        value: R | None,
        record: Record,
        correlation_id: str | None,
        handler: Callable[..., Any],
        returns: Any,
    ) -> Handled[R]:
        """The outcome of a transaction that committed (or a claim that was no one's)."""
        if step is not Step.PROCEED:
            return typed_repeat(
                self._rules.settle(step, claim, correlation_id, started), handler, returns
            )
        if claim.status is ClaimStatus.NEW:
            return self._rules.processed(key, started, value, record, correlation_id)
        return self._rules.done(
            Outcome.STALE_RECLAIMED,
            key,
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
        found: str | Handled[R] = self._rules.message_key(envelope, key, perf_counter())
        if isinstance(found, Handled):
            return found
        return await self.handle_in_transaction(
            found,
            envelope.body,
            handler,
            tx=tx,
            savepoint=savepoint,
            correlation_id=envelope.correlation_id,
            returns=None,  # as in handle_message
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
        # of oncely's own). A store that checks the claim at the commit (DynamoDB) refuses
        # it when another worker recorded the key since it was read (KeyTaken, nothing
        # written): in oncely's own transaction the key is claimed again, once, and the
        # record found is kept, as a SQL store's claim finds it.
        for again in (True, False):
            block: AbstractAsyncContextManager[Tx] = (
                store.transaction() if tx is None else nullcontext(tx)
            )
            try:
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
            except KeyTaken:
                if tx is None and again:
                    continue
                raise
            return


class _BatchRun(Generic[R]):
    """One batch's run: its groups' handlers, and its completions, gathered (one round trip
    for what finished) at the end, or earlier for groups that end while others still run
    (``early``, for a consumer that settles messages as they end)."""

    def __init__(
        self,
        inbox: AsyncInbox,
        entries: Sequence[tuple[str | Handled[R], Any, str | None]],
        handler: AsyncHandler[Any, R],
        stop: Callable[[Hashable], bool] | None,
        started: float,
        results: list[Handled[R] | None],
        held: dict[int, Record],
        groups: int,
        ordered: bool,
    ) -> None:
        self.inbox = inbox
        self.entries = entries
        self.handler = handler
        self.stop = stop
        self.started = started
        self.results = results
        self.held = held
        self.finished: list[tuple[int, Claim, R | None, bytes | None, str | None]] = []
        self.completed: dict[int, Claim] = {}
        self.waiting = groups
        """Groups not ended yet."""
        self.ended: list[int] = []
        """Indexes of groups that ended, not reported early yet."""
        self.early: Gather | None = None
        self.ordered = ordered
        """The items came with their groups: one given back (``in_flight``) while its group
        runs holds back the rest of the group, as one the batch's claim found held does."""

    async def run(self, group: Hashable, members: list[tuple[int, Claim, Step]]) -> None:
        await self._run_group(group, members)
        self.waiting -= 1
        if self.early is not None and self.waiting > 0:
            self.ended.extend(i for i, _claim, _step in members)
            self.early.soon()

    async def report(self, settled: Early[R]) -> None:
        """Complete what the ended groups finished, in one round trip, and tell ``settled``
        their outcomes."""
        now = set(self.ended)
        self.ended.clear()
        ready = [f for f in self.finished if f[0] in now]
        self.finished[:] = [f for f in self.finished if f[0] not in now]
        await self.complete(ready)
        order = sorted(i for i in now if self.results[i] is not None)
        await settled(order, [cast(Handled[R], self.results[i]) for i in order])

    async def complete(
        self, ready: list[tuple[int, Claim, R | None, bytes | None, str | None]]
    ) -> None:
        """Complete ``ready`` (handlers that returned) in one round trip: their outcomes."""
        if not ready:
            return
        inbox = self.inbox
        answers = await inbox._complete_many(_completions(ready))
        for (i, claim, result, _data, note), done in zip(ready, answers, strict=True):
            self.held.pop(i, None)
            self.results[i] = inbox._outcome(
                claim, result, note, done, self.entries[i][2], self.started
            )
            if isinstance(done, Record):
                self.completed[i] = Claim(ClaimStatus.EXISTING, done, claim.now_ms)

    async def _run_group(self, group: Hashable, members: list[tuple[int, Claim, Step]]) -> None:
        inbox, results, started = self.inbox, self.results, self.started
        held_back: str | None = None
        for i, claim, step in members:
            _key, payload, correlation_id = self.entries[i]
            record = claim.record
            if held_back is None and self.stop is not None and self.stop(group):
                held_back = "not started: the consumer is stopping or gave up its group"
            if held_back is not None:
                self.held.pop(i, None)
                await inbox._release_quietly(record.key, record.token)
                results[i] = inbox._rules.done(
                    Outcome.IN_FLIGHT,
                    record.key,
                    started,
                    reason=held_back,
                    attempt=record.attempt,
                    correlation_id=correlation_id,
                )
                continue
            if step is Step.STALE:  # rare: the one-message path has the reconciler logic
                results[i] = await inbox.handle(
                    record.key, payload, self.handler, correlation_id=correlation_id, returns=None
                )
            else:
                result, error = await inbox._invoke(claim, payload, self.handler, correlation_id)
                if error is None:
                    data, note = (
                        (None, None)
                        if result is None
                        else inbox._rules.encode(result, strict=False)
                    )
                    self.finished.append((i, claim, result, data, note))
                    continue
                self.held.pop(i, None)
                results[i] = await inbox._raised(record, error, correlation_id, started)
            outcome = results[i]
            if outcome is not None and outcome.outcome is Outcome.FAILED:
                held_back = (
                    "held back: the earlier message with key "
                    f"{inbox._rules.shown(record.key)} of its group failed, and the group's "
                    "order is kept"
                )
            elif outcome is not None and outcome.outcome is Outcome.IN_FLIGHT and self.ordered:
                # Given back while its group ran (a lapsed claim another worker took over
                # while the reconciler looked, a lease lost before a rejection): it comes
                # again, so what follows it in its group waits for it.
                held_back = (
                    "held back: the earlier message with key "
                    f"{inbox._rules.shown(record.key)} of its group was given back (its key "
                    "held elsewhere), and the group's order is kept"
                )


class AsyncClaimed(Generic[R]):
    """A claim from :meth:`AsyncInbox.claim`: the work is the caller's to do and to end.

    ``won`` says whether this caller holds the key now. If it does, exactly one ending counts:
    :meth:`complete` (the work is done: the result is stored for every later copy),
    :meth:`release` (not done: the next caller runs it) or :meth:`reject` (poison: recorded,
    never run again). Each is fenced by the claim's token: a caller whose lease lapsed and was
    taken over gets ``in_flight`` (the new owner's result wins), never overwriting it.

    If it does not, ``handled`` already holds the outcome: ``duplicate`` with the stored
    result, ``in_flight``, ``key_conflict``, ``rejected`` or ``escalated``. After an ending,
    ``handled`` is that ending's outcome. A second ending, or one of a claim not won, raises
    :class:`~oncely.ClaimEnded`.
    """

    __slots__ = ("_beat", "_claim", "_correlation_id", "_handled", "_inbox", "_started")

    def __init__(
        self,
        inbox: AsyncInbox,
        claim: Claim | None,
        correlation_id: str | None,
        started: float,
        handled: Handled[R] | None = None,
    ) -> None:
        self._inbox = inbox
        self._claim = claim
        self._correlation_id = correlation_id
        self._started = started
        self._handled = handled
        self._beat: AsyncTicket | None = None
        if claim is not None and inbox._lease.heartbeat:
            record = claim.record
            self._beat = inbox._heartbeats.start(
                functools.partial(inbox._renew, record.key, record.token), inbox._renew_every
            )

    def __repr__(self) -> str:
        state = "won" if self.won else "ended" if self._claim is not None else "not won"
        outcome = f" {self._handled.outcome.value}" if self._handled is not None else ""
        return f"<AsyncClaimed {self._inbox.consumer}/{self.key!r} {state}{outcome}>"

    @property
    def won(self) -> bool:
        """Whether this caller holds the claim and has not ended it."""
        return self._claim is not None and self._handled is None

    @property
    def handled(self) -> Handled[R] | None:
        """The outcome: at once when the claim was not won, after an ending otherwise."""
        return self._handled

    @property
    def key(self) -> str | None:
        """The key as stored (None when it was refused)."""
        if self._claim is not None:
            return self._claim.record.key
        return self._handled.key if self._handled is not None else None

    @property
    def attempt(self) -> int:
        """The attempt this claim is (1 for the first; more after releases and takeovers)."""
        if self._claim is not None:
            return self._claim.record.attempt
        return self._handled.attempt or 0 if self._handled is not None else 0

    @property
    def reclaimed(self) -> bool:
        """Whether the claim was taken over from an earlier attempt whose lease lapsed (its
        effects may have happened: check before doing them again)."""
        return self._claim is not None and self._claim.status is ClaimStatus.TAKEN_OVER

    def downstream_key(self, step: str = "") -> str:
        """The idempotency key to pass on to a service this work calls (R17): the one a
        handler of this key gets from ``oncely.handling().downstream_key(step)``, and a
        reconciler from ``StaleClaim.downstream_key(step)``, the same on every attempt.
        :class:`LookupError` for a claim refused before it had a key."""
        key = self.key
        if key is None:
            raise LookupError("this claim was refused before it had a key: nothing to pass on")
        return downstream_key(self._inbox.consumer, key, step)

    def _holding(self, ending: str) -> Claim:
        claim = self._claim
        if claim is None or self._handled is not None:
            why = self._handled.outcome.value if self._handled is not None else "not won"
            raise ClaimEnded(
                f"cannot {ending} the claim of {self.key!r}: it is {why}"
                + (" (ended already)" if claim is not None else "")
            )
        return claim

    async def _stop_beat(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None:
            await beat.stop()

    def __del__(self) -> None:
        # Collected while still held (no complete, release or reject, no ``with`` block):
        # its heartbeat would renew the lease for as long as the process lives, and the key
        # stay in_flight for everyone. Renewal stops; the lease lapses and the key is taken
        # over (stale_reclaimed) by the next caller.
        beat = getattr(self, "_beat", None)
        if beat is None or getattr(self, "_handled", None) is not None:
            return
        beat.abandon()
        claim = getattr(self, "_claim", None)
        key = claim.record.key if claim is not None else "?"
        warnings.warn(
            f"oncely: the claim of {key!r} was dropped without complete(), release() or "
            "reject(); its lease is no longer renewed, and the key is taken over once it "
            "lapses. End every claim, or use it as a context manager",
            ResourceWarning,
            stacklevel=1,
        )

    async def complete(self, result: R | None = None, *, not_kept: str | None = None) -> Handled[R]:
        """The work is done: store ``result`` (what a later copy gets as its ``duplicate``
        value) and end the claim. ``processed`` (``stale_reclaimed`` after a takeover), or
        ``in_flight`` when another caller took the key over meanwhile (its result wins).

        ``not_kept``, instead of a result, says why the work's result is not here to keep
        (another task produces it, say): a later copy's ``duplicate`` has no value and the
        reason ``result not stored: <not_kept>``, as for a result over ``max_result_bytes``,
        so it is not taken for a result of ``None`` (the task integrations raise
        :class:`~oncely.ResultUnavailable` for it)."""
        if result is not None and not_kept is not None:
            raise ValueError("complete() takes a result or why there is none (not_kept), not both")
        refuse_result(result)
        claim = self._holding("complete")
        await self._stop_beat()
        handled: Handled[R] = await self._inbox._finish(
            claim, result, self._correlation_id, self._started, not_kept
        )
        self._handled = handled
        return handled

    async def release(self, reason: str = "released by the caller") -> Handled[R]:
        """The work was not done: give the key back, so the next caller (a redelivery, a
        retried request) runs it. The outcome is ``failed`` with ``reason``."""
        claim = self._holding("release")
        await self._stop_beat()
        record = claim.record
        await self._inbox._release_quietly(record.key, record.token)
        handled: Handled[R] = self._inbox._rules.failed(
            record.key, Released(reason), self._started, self._correlation_id, record.attempt
        )
        self._handled = handled
        return handled

    async def reject(self, reason: str) -> Handled[R]:
        """The work can never be done (a poison message): record the key as failed with
        ``reason``; later copies are ``rejected`` without running anything."""
        claim = self._holding("reject")
        await self._stop_beat()
        handled: Handled[R] = await self._inbox._reject(
            claim.record, reason, self._correlation_id, self._started
        )
        self._handled = handled
        return handled

    async def renew(self) -> None:
        """Extend the lease now (with ``Lease(heartbeat=False)``, the caller's to do more often
        than the lease lasts). Raises :class:`~oncely.LeaseLost` when another caller owns the
        key now: stop the work."""
        claim = self._holding("renew")
        inbox = self._inbox
        await inbox._store.renew(
            inbox._consumer,
            claim.record.key,
            token=claim.record.token,
            lease_ms=inbox._lease_ms,
            keep_ms=inbox._keep_ms,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        """A block that raised releases the claim (rejects it for a
        :class:`~oncely.Reject`), one that ended with the claim still won releases it too."""
        if not self.won:
            return
        if isinstance(error, Reject):
            await self.reject(error.reason)
        elif error is not None:
            await self.release(f"the block raised {said(error)}")
        else:
            await self.release("the block ended without completing the claim")
