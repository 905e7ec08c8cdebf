"""The consumer loop shared by every broker: read, decode, run through the inbox, settle.

The loop decides nothing about a message: the inbox's outcome names the broker action
(:mod:`oncely._core.outcomes`) and the transport carries it out (:mod:`._shape`). What the loop
owns is the plumbing around that: bounded concurrency, heartbeats for long handlers, retries
and dead-lettering by delivery count, reconnection, and a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

from oncely import Action, Handled, Outcome, RedeliveryHorizon, format_duration
from oncely._core.clock import to_ms
from oncely._core.handlers import called_misfit
from oncely._core.observe import key_for_logs, log_error, redact_keys
from oncely._core.records import Record, Status
from oncely.brokers._common import flag
from oncely.brokers._give_backs import GiveBacks, failed_reason
from oncely.brokers._shape import BrokerLimits, ConsumerSettings, DeadLetter, Delivery, Transport
from oncely.errors import BrokerUnavailable, ConfigurationError, UndecodableBody
from oncely.inbox.async_inbox import AsyncInbox, Early
from oncely.inbox.heartbeats import AsyncHeartbeats
from oncely.inbox.sync_inbox import Inbox
from oncely.keys import Envelope, KeySource, MessageIdKey
from oncely.stores.async_protocols import AsyncKeepsOffsets, AsyncTransactionalStore
from oncely.stores.async_purging import AsyncPurgeService
from oncely.tracing import Tracing, consumer_spans
from oncely.wire import escaped, printable

if TYPE_CHECKING:
    from oncely._otel import ConsumerSpans

__all__ = ["BrokerConsumer", "InboxProcessor", "Processor", "UndecodableBody", "decode_body"]

LOGGER = logging.getLogger("oncely.broker")
_T = TypeVar("_T")

Mode = Literal["two_phase", "transactional"]
Decoder = Callable[[Envelope], object]
Position = tuple[str, int, int]
"""Where a delivery sits in a partitioned stream: (stream, partition, the next offset)."""


def decode_body(envelope: Envelope) -> object:
    """The default decoder: JSON unless the content type says otherwise.

    ``application/json`` (or ``+json``) and a message with no content type are parsed as JSON;
    ``text/*`` is decoded as UTF-8; any other type is passed on as ``bytes``. A body that does
    not decode raises :class:`UndecodableBody` (the message is rejected with that reason).
    """
    body = envelope.body
    if not isinstance(body, bytes | bytearray | memoryview):
        return body
    raw = bytes(body)
    content_type = envelope.transport.get("content_type")
    kind = str(content_type).split(";", 1)[0].strip().lower() if content_type else ""
    if not kind or kind == "application/json" or kind.endswith("+json"):
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise UndecodableBody(
                f"the body is not JSON ({exc}); send JSON, or a content type that says what it "
                "is (text/plain: a str, application/octet-stream: bytes), or give "
                "BrokerConsumer a decoder (decode=...)"
            ) from None
    if kind.startswith("text/"):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UndecodableBody(f"the {kind} body is not UTF-8 ({exc})") from None
    return raw


_CALLED_AS: Mapping[str, str] = {"two_phase": "(payload)", "transactional": "(tx, payload)"}


def handler_misfit(handler: object, mode: Mode) -> str | None:
    """Why ``handler`` cannot run in ``mode``, which calls it as ``handler(payload)``
    (two-phase) or ``handler(tx, payload)`` (transactional), as the end of a sentence naming
    it (``takes (payload), but ...``); None when it can, or when that cannot be told for sure
    (:func:`~oncely._core.handlers.misfit`)."""
    return called_misfit(handler, _CALLED_AS[mode], f"the {mode.replace('_', '-')} mode")


class Processor(Protocol):
    """What a :class:`BrokerConsumer` runs for each decoded message: an inbox and a handler
    (:class:`InboxProcessor`), or any code that returns an :class:`~oncely.Handled`, such as a
    consumer whose business row is its own marker (``EntityResult.handled``, R6)."""

    @property
    def consumer(self) -> str:
        """The consumer name recorded on dead-lettered messages."""
        ...

    async def process(self, envelope: Envelope) -> Handled[Any]:
        """The outcome of one message (the body is decoded). Raising means the message could
        not be processed now (the store is down): it is given back, never acknowledged."""
        ...

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        """The ``rejected`` outcome for a message that cannot be processed at all. ``key`` is
        the producer's message id when it is readable, for the log line only."""
        ...

    # Optional: ``dead_lettered(handled) -> None``, told the ``rejected`` outcome of a message
    # dead-lettered after its retries (InboxProcessor's passes it to the inbox's hooks).
    # Optional: ``async def prepare(self) -> None``, awaited once by BrokerConsumer.run before
    # the broker is read (InboxProcessor's checks the store). Not part of the protocol, so that
    # a processor written before it still is one. Optional too: ``log_keys`` ("plain" or
    # "hash", how the consumer's log lines show keys) and ``key_of(envelope) -> str | None``
    # (the key of a message the store failed on, for its log line; else its message id).


class InboxProcessor:
    """Runs ``handler`` through ``inbox``: two-phase (``handler(payload)``) or transactional
    (``handler(transaction, payload)``), with the key read by ``key`` (default: the producer's
    message id). The payload is the decoded body, or what ``payload`` reads from the message
    (``oncely.cloudevents.event_data``: a CloudEvent's data); the key is always read
    from the whole message, and the fingerprint is the payload's. A message ``payload``
    cannot read is ``rejected`` with its reason.

    ``store_offsets=True`` (transactional mode, a store that keeps offsets: the SQL and
    DynamoDB stores)
    writes the message's position in its stream (a Kafka partition's next offset), when the
    consumer passes one, in the handler's transaction with the marker and the business
    writes."""

    def __init__(
        self,
        inbox: AsyncInbox,
        handler: Callable[..., Awaitable[Any]],
        *,
        mode: Mode = "two_phase",
        key: KeySource | None = None,
        payload: Callable[[Envelope], object] | None = None,
        store_offsets: bool = False,
    ) -> None:
        if mode not in ("two_phase", "transactional"):
            raise ConfigurationError(f"mode must be 'two_phase' or 'transactional', not {mode!r}")
        if mode == "transactional" and not isinstance(inbox.store, AsyncTransactionalStore):
            raise ConfigurationError(
                f"{type(inbox.store).__name__} cannot join a transaction; the transactional "
                "mode needs a SQL store (PostgreSQL, MariaDB/MySQL, SQLite) or DynamoDB, or use "
                "two_phase"
            )
        wrong = handler_misfit(handler, mode)
        if wrong is not None:
            # Else every message would fail with the TypeError and be dead-lettered.
            raise ConfigurationError(f"the handler {_name(handler)} {wrong}")
        self.offsets: AsyncKeepsOffsets[Any] | None = None
        """The store that keeps the offsets, with ``store_offsets=True``."""
        if flag(store_offsets, "store_offsets"):
            if mode != "transactional":
                raise ConfigurationError(
                    "store_offsets writes the offset in the handler's transaction: it needs "
                    "mode='transactional'"
                )
            if not isinstance(inbox.store, AsyncKeepsOffsets):
                raise ConfigurationError(f"{type(inbox.store).__name__} keeps no offsets")
            self.offsets = inbox.store
        self._offsets_ready = False
        self.inbox = inbox
        self._handler = handler
        self._transactional = mode == "transactional"
        self._key = key
        self._payload = payload

    @property
    def consumer(self) -> str:
        return self.inbox.consumer

    @property
    def log_keys(self) -> Literal["plain", "hash"]:
        """How the inbox shows keys in its log lines; the consumer's lines follow it."""
        return self.inbox.log_keys

    def key_of(self, envelope: Envelope) -> str | None:
        """The key ``envelope`` is claimed under, for a log line about a message that has no
        outcome (the store failed); None when it has none."""
        source = self._key if self._key is not None else MessageIdKey()
        try:
            key = source(envelope)
        except Exception:
            return None
        return key if isinstance(key, str) and key and not escaped(key) else None

    async def prepare(self) -> None:
        """Connect to the store and check its schema (and, with ``store_offsets``, make the
        offsets table ready) before the first message: :meth:`BrokerConsumer.run` awaits it
        at start, so a store that is down stops the start instead of every message."""
        await self.inbox.prepare()
        if self.offsets is not None:
            await self._offsets_table(self.offsets)

    async def _offsets_table(self, offsets: AsyncKeepsOffsets[Any]) -> None:
        """The offsets table made ready, once: before any transaction (DDL must not join
        one)."""
        if not self._offsets_ready:
            await offsets.prepare_offsets()
            self._offsets_ready = True

    async def process(
        self, envelope: Envelope, *, position: Position | None = None
    ) -> Handled[Any]:
        """The message's outcome; with ``store_offsets``, its ``position`` (where given) is
        written in the handler's transaction."""
        key: KeySource | None = self._key
        if self._payload is not None:
            try:
                data = self._payload(envelope)
            except Exception as exc:
                return self.refuse(
                    f"cannot read the payload: {exc}",
                    key=self.key_of(envelope),
                    correlation_id=envelope.correlation_id,
                )
            key = _KeyOf(envelope, key if key is not None else MessageIdKey())
            envelope = replace(envelope, body=data)
        if self._transactional:
            offsets = self.offsets
            if offsets is None or position is None:
                return await self.inbox.handle_message_in_transaction(
                    envelope, self._handler, key=key
                )
            await self._offsets_table(offsets)
            handler = functools.partial(
                _at_position, offsets, self.consumer, position, self._handler
            )
            handled = await self.inbox.handle_message_in_transaction(envelope, handler, key=key)
            if handled.outcome is Outcome.DUPLICATE:
                # A copy of a message finished earlier: no handler ran, so its position goes
                # in a transaction of its own (else, once the marker expires, a group that
                # lost its commits would read the copy again and run it again).
                await self.save_position(position)
            return handled
        return await self.inbox.handle_message(envelope, self._handler, key=key)

    async def save_position(self, position: Position) -> None:
        """With ``store_offsets``: write ``position`` in a transaction of its own, for a
        message finished without a handler's transaction to carry it (a duplicate; a dead
        letter, once the broker confirmed its copy). Positions only move forward: an older
        one than the stored one changes nothing. Without ``store_offsets``, nothing."""
        offsets = self.offsets
        if offsets is None:
            return
        await self._offsets_table(offsets)
        store = cast(AsyncTransactionalStore[Any], self.inbox.store)
        async with store.transaction() as tx:
            await offsets.save_offset_in(tx, self.consumer, *position)

    async def process_batch(
        self,
        envelopes: Sequence[Envelope],
        groups: Sequence[Hashable],
        concurrency: int,
        stop: Callable[[Hashable], bool],
        positions: Sequence[Position | None] | None = None,
        *,
        settled: Early[Any] | None = None,
        slots: asyncio.Semaphore | None = None,
    ) -> list[Handled[Any]]:
        """The outcomes of a batch of messages (bodies decoded), in order: one claim and one
        completion for all of them in the two-phase mode; in the transactional mode, each
        message's own transaction, the messages of one group in order. Once ``stop(group)`` is
        true, the group's messages not started yet are not started (``in_flight``).
        ``positions`` (with ``store_offsets``): each message's position, or None where it must
        not be written. ``settled`` (two-phase mode): told the outcomes of groups that end
        while others still run (:meth:`AsyncInbox.handle_messages`); ``slots``: a semaphore
        bounding the groups of several batches together, in place of ``concurrency``."""
        if self._transactional or self._payload is not None:
            return await _each(self, envelopes, groups, concurrency, stop, positions, slots)
        return await self.inbox.handle_messages(
            envelopes,
            self._handler,
            key=self._key,
            groups=groups,
            concurrency=concurrency,
            stop=stop,
            settled=settled,
            slots=slots,
        )

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        return self.inbox.refuse(reason, key=key, correlation_id=correlation_id)

    def _wrap_handler(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Run the handler as ``wrap(handler)`` (a consumer's tracing: each of a batch's
        handlers under its message's span)."""
        self._handler = wrap(self._handler)

    def dead_lettered(self, handled: Handled[Any]) -> None:
        """Pass the ``rejected`` end of a message dead-lettered after its retries to the
        inbox's hooks (the consumer logged it already)."""
        self.inbox._rules.observer.notify(handled)


async def _at_position(
    store: AsyncKeepsOffsets[Any],
    consumer: str,
    position: Position,
    handler: Callable[..., Awaitable[Any]],
    tx: Any,
    payload: object,
) -> Any:
    """``handler(tx, payload)``, with the message's position written in ``tx`` first."""
    stream, part, next_offset = position
    await store.save_offset_in(tx, consumer, stream, part, next_offset)
    return await handler(tx, payload)


_FINISHED_HERE = (Outcome.PROCESSED, Outcome.DUPLICATE)
"""Outcomes that leave nothing for the broker to do but the ack: a later message's stored
position may pass such a message. Any other (a dead letter still to copy, a retry, a copy
in flight elsewhere) must stay before every stored position."""


async def _each(
    processor: Processor,
    envelopes: Sequence[Envelope],
    groups: Sequence[Hashable],
    concurrency: int,
    stop: Callable[[Hashable], bool],
    positions: Sequence[Position | None] | None = None,
    shared: asyncio.Semaphore | None = None,
) -> list[Handled[Any]]:
    """A batch as one :meth:`Processor.process` per message: the messages of one group in
    order, up to ``concurrency`` groups at once. Once a message of a group fails or is given
    back (``in_flight``: its key held elsewhere), the later ones of that group are not
    processed (``in_flight``: they come again after it); once
    ``stop(group)`` is true, no message of the group not started yet is. With ``positions``
    (an :class:`InboxProcessor` that stores offsets), each message's position is written with
    it, until a message of its group ends otherwise than processed or duplicate: the later
    ones of that group write none (a stored position never passes a message whose broker
    action is still to come)."""
    results: list[Handled[Any] | None] = [None] * len(envelopes)
    runs: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        runs.setdefault(group, []).append(i)
    slots = shared if shared is not None else asyncio.Semaphore(concurrency)

    async def run(group: Hashable, members: list[int]) -> None:
        async with slots:
            held_back: str | None = None
            write = True
            for i in members:
                envelope = envelopes[i]
                if held_back is None and stop(group):
                    held_back = "not started: the consumer is stopping or gave up its group"
                if held_back is not None:
                    results[i] = Handled(
                        Outcome.IN_FLIGHT,
                        processor.consumer,
                        envelope.message_id,
                        reason=held_back,
                        correlation_id=envelope.correlation_id,
                    )
                    continue
                if positions is None:
                    handled = await processor.process(envelope)
                else:
                    assert isinstance(processor, InboxProcessor)
                    handled = await processor.process(
                        envelope, position=positions[i] if write else None
                    )
                    write = write and handled.outcome in _FINISHED_HERE
                results[i] = handled
                if handled.outcome is Outcome.FAILED:
                    held_back = "held back: an earlier message of its group failed"
                elif handled.outcome is Outcome.IN_FLIGHT:
                    # Given back too (its key held elsewhere): what follows it waits for it.
                    held_back = "held back: an earlier message of its group was given back"

    await asyncio.gather(*(run(group, members) for group, members in runs.items()))
    return [handled for handled in results if handled is not None]


@dataclass(frozen=True, slots=True)
class _KeyOf:
    """The key of ``whole`` (the message as it came), whatever envelope it is asked about."""

    whole: Envelope
    source: KeySource

    def __call__(self, envelope: Envelope) -> str:
        return self.source(self.whole)


class BrokerConsumer:
    """Runs ``handler`` once per logical message read from ``transport``, through ``inbox``.

    ``mode="two_phase"`` calls ``handler(payload)`` under a lease (:meth:`AsyncInbox.handle`);
    ``mode="transactional"`` calls ``handler(transaction, payload)`` with the marker in the
    same transaction (:meth:`AsyncInbox.handle_in_transaction`, SQL and DynamoDB stores).
    ``key`` reads the dedup key of each message (default: the producer's message id, R2); a
    message without one is dead-lettered as ``rejected``, never processed unprotected (R4).

    ``store_offsets=True`` (transactional mode on a SQL or DynamoDB store, a Kafka transport)
    keeps each partition's next offset in the handler's transaction, beside the marker and
    the business writes, and starts each assigned partition from it when it is ahead of the
    offset the broker has committed: the database, not the broker's commit, says how far the
    consumer got, whatever the inbox's retention.

    Instead of an inbox and a handler, a :class:`Processor` can produce each outcome itself.
    :meth:`run` reads until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals=True``).
    ``counts`` holds how many deliveries ended in each outcome, plus ``store_unavailable``
    for deliveries given back because the store failed, ``dead_lettered_after_retries`` for
    failures dead-lettered after ``max_deliveries`` (counted once the copy is written),
    ``dead_letter_failed`` for dead-letter copies that were not written (the message was
    given back), and ``settle_failed`` for any broker action that failed.

    ``tracing=True`` (or an OpenTelemetry ``TracerProvider``) makes a CONSUMER span per
    delivery, a child of the context its producer put in its headers, with the handler run
    under it (:mod:`oncely.tracing`); off by default, when nothing of OpenTelemetry is
    imported.
    """

    _horizon_advice: Callable[[RedeliveryHorizon], str] | None = None
    """What a retention shorter than the horizon should do, in the words of whoever set the
    consumer up (``oncely consume`` names its flags); None: the library's names."""
    _watching: set[asyncio.Task[None]]
    """The watches of the ``in_flight`` copies held while their key's record is read: at most
    :attr:`_most_watched` at once."""

    def __init__(
        self,
        transport: Transport,
        inbox: AsyncInbox | Processor,
        handler: Callable[..., Awaitable[Any]] | None = None,
        *,
        mode: Mode = "two_phase",
        key: KeySource | None = None,
        settings: ConsumerSettings | None = None,
        decode: Decoder = decode_body,
        logger: logging.Logger | None = None,
        store_offsets: bool = False,
        tracing: Tracing = False,
    ) -> None:
        flag(store_offsets, "store_offsets")
        if isinstance(inbox, AsyncInbox):
            if handler is None:
                raise ConfigurationError("BrokerConsumer needs a handler to run through the inbox")
            self.processor: Processor = InboxProcessor(
                inbox, handler, mode=mode, key=key, store_offsets=store_offsets
            )
        elif isinstance(inbox, Inbox):
            raise ConfigurationError(
                "BrokerConsumer runs on asyncio: give it an AsyncInbox (over an asyncio store: "
                "oncely.open_async(url)), not the sync oncely.Inbox; the handler may "
                "still be a plain function"
            )
        else:
            if handler is not None:
                raise ConfigurationError(
                    "a Processor runs its own handler; pass no handler (or give an AsyncInbox "
                    "and a handler)"
                )
            if store_offsets:
                raise ConfigurationError(
                    "with a Processor, give store_offsets to it (InboxProcessor(..., "
                    "store_offsets=True)); a Processor of your own writes offsets itself"
                )
            self.processor = inbox
        self._positions: InboxProcessor | None = None
        """The processor that writes each delivery's position (``store_offsets``)."""
        made = self.processor
        if isinstance(made, InboxProcessor) and made.offsets is not None:
            start_from = getattr(transport, "start_from", None)
            if start_from is None:
                raise ConfigurationError(
                    "store_offsets needs a transport that reads a partitioned stream from a "
                    f"given offset (Kafka); {transport.name} has none"
                )
            start_from(
                functools.partial(made.offsets.offsets, made.consumer), save=made.save_position
            )
            self._positions = made
        self.transport = transport
        set_inbox_consumer = getattr(transport, "set_inbox_consumer", None)
        if set_inbox_consumer is not None:
            # The dead letters a transport writes by itself name the inbox's consumer too.
            set_inbox_consumer(self.processor.consumer)
        self.settings = settings if settings is not None else ConsumerSettings()
        self.counts: Counter[str] = Counter()
        self._decode = decode
        self._log = logger if logger is not None else LOGGER
        self._log_keys: Literal["plain", "hash"] = getattr(self.processor, "log_keys", "plain")
        """How keys show in this consumer's log lines: as the inbox shows them in its own
        (``log_keys="hash"`` keeps a key that is personal data out of every line)."""
        self._spans: ConsumerSpans | None = self._consumer_spans(tracing)
        """A span per delivery (``tracing``); None, and nothing of OpenTelemetry imported,
        with tracing off."""
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(self.settings.concurrency)
        """Handlers running at once (one message at a time), or groups (batches, all of
        them together)."""
        self._unsettled = 0
        """Deliveries of batches read and not settled yet (at most ``batch``)."""
        self._room = asyncio.Event()
        """Set when a batch's delivery is settled: the next batch may be read."""
        self._heartbeats = AsyncHeartbeats()
        self._draining = False
        """Set once :meth:`run` is ending: no ``in_flight`` copy is held any more."""
        self._watching: set[asyncio.Task[None]] = set()
        self._rerunning: set[int] = set()
        """The deliveries (by id) an ``in_flight`` copy's watch runs through the inbox again:
        their spans are their own, not the batch's they came in."""
        self._given_back = GiveBacks()
        """How many times this process gave each unfinished message back unrun (a copy
        ``in_flight``, the store away, a shutdown), by its identity on the broker
        (:func:`_identity`): deliveries the broker counts that were no failures."""

    def _consumer_spans(self, tracing: Tracing) -> ConsumerSpans | None:
        """The spans of this consumer's deliveries (None with tracing off), the processor's
        handler run under them."""
        if tracing is False:
            return None
        spans = consumer_spans(
            tracing,
            system=self.transport.name,
            destination=_destination(self.transport),
            consumer=self.processor.consumer,
            log_keys=self._log_keys,
        )
        if spans is not None and isinstance(self.processor, InboxProcessor):
            self.processor._wrap_handler(spans.handler)
        return spans

    # ------------------------------------------------------------------ running

    def stop(self) -> None:
        """Ask :meth:`run` to stop reading, finish running handlers and return."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self, *, handle_signals: bool = False) -> None:
        """Read and process messages until :meth:`stop`. The store is checked first: one that
        is down at start raises :class:`~oncely.StoreUnavailable` (a schema it cannot use, a
        :class:`~oncely.SchemaError`) before the broker is read. Connection loss is ridden
        out: the transport reconnects with ``settings.reconnect`` backoff and the broker
        redelivers whatever was not settled. Returns after a graceful stop (see
        ``shutdown_grace``)."""
        loop = asyncio.get_running_loop()
        if flag(handle_signals, "handle_signals"):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        purge: AsyncPurgeService | None = None
        purging: asyncio.Task[None] | None = None
        self._draining = False
        try:
            await self._prepare()
            await self._open()
            if self.stopping:  # stopped before the broker answered: nothing of it is known
                return
            self._check_horizon()
            purge = self._purge_service()
            purging = asyncio.create_task(purge.run()) if purge is not None else None
            await self._read()
        finally:
            try:
                await self._drain()
            finally:
                if purge is not None and purging is not None:
                    purge.stop()
                    await asyncio.gather(purging, return_exceptions=True)
                await self.transport.close()
                if handle_signals:
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        loop.remove_signal_handler(sig)

    @property
    def horizon(self) -> RedeliveryHorizon:
        """This consumer's redelivery horizon (R13), from its settings and what the transport
        says about the broker (:meth:`ConsumerSettings.horizon`); exact once :meth:`run`
        has opened the transport (a broker's limits are read when it connects)."""
        return self.settings.horizon(self._limits())

    def _limits(self) -> BrokerLimits:
        limits = getattr(self.transport, "limits", None)
        if isinstance(limits, BrokerLimits):
            return limits
        every = self.transport.extend_every
        return BrokerLimits(ack_wait=every * 3 if every is not None else None)

    def _check_horizon(self) -> None:
        """Refuse an inbox that forgets records before the broker stops redelivering (R13)."""
        inbox = getattr(self.processor, "inbox", None)
        if not isinstance(inbox, AsyncInbox | Inbox):
            return  # a processor of your own keeps its own records
        limits = self._limits()
        horizon = self.settings.horizon(limits)
        retention = inbox.retention
        retention.check(
            horizon,
            of=f" of this consumer on {self.transport.name}",
            advice=self._horizon_advice(horizon)
            if self._horizon_advice is not None
            else "raise the inbox's Retention(keep=...), or lower max_deliveries, the "
            "backoff, the ack wait or ConsumerSettings.resubmit_window",
        )
        most = limits.max_deliveries
        if most is not None and 0 < most <= self.settings.max_deliveries:
            self._log.warning(
                "oncely broker=%s consumer=%s the broker's own delivery limit %d%s is not above "
                "max_deliveries=%d: a message that keeps failing, or is given back while a "
                "copy runs, is dead-lettered on its delivery %d, before its retries are spent; "
                "raise the broker's limit above max_deliveries",
                self.transport.name,
                self.processor.consumer,
                most,
                f" ({limits.source})" if limits.source else "",
                self.settings.max_deliveries,
                most,
            )
        self._log.info(
            "oncely broker=%s consumer=%s redelivery horizon %s = %s%s; retention %s covers it",
            self.transport.name,
            self.processor.consumer,
            format_duration(horizon.total),
            horizon.explain(),
            f" (from {limits.source})" if limits.source else "",
            format_duration(retention.keep),
            extra={
                "oncely_broker": self.transport.name,
                "oncely_consumer": self.processor.consumer,
                "oncely_horizon_ms": to_ms(horizon.total),
                "oncely_retention_ms": retention.keep_ms,
            },
        )

    def _purge_service(self) -> AsyncPurgeService | None:
        every = self.settings.purge_every
        inbox = getattr(self.processor, "inbox", None)  # a processor of your own has none
        if every is None or inbox is None:
            return None
        if not isinstance(inbox, AsyncInbox):
            raise ConfigurationError(
                "purge_every runs the purge in the consumer's event loop and needs an async "
                f"inbox; this processor's inbox is {type(inbox).__name__}: run the purge as "
                "its own process instead (oncely inbox purge --every 1m)"
            )
        return AsyncPurgeService(inbox.store, every=every)

    async def _prepare(self) -> None:
        """The processor's own check before the broker is read (an :class:`InboxProcessor`'s:
        its store reachable, its schema usable): a store that is down or a schema this oncely
        cannot use stops the start with its error, rather than giving back every message."""
        prepare = getattr(self.processor, "prepare", None)
        if prepare is not None:
            await prepare()

    async def _open(self) -> None:
        """Open the transport, riding out an unavailable broker; a stop asked meanwhile
        abandons the attempt (a Kafka group join can take a rebalance or two)."""
        failures = 0
        while not self.stopping:
            opening = await self._unless_stopped(
                self.transport.open(max(self.settings.concurrency, self.batch))
            )
            if opening.cancelled():
                return
            try:
                opening.result()
                return
            except BrokerUnavailable as exc:
                failures += 1
                await self._pause(self.settings.reconnect.delay(failures), exc)

    @property
    def batch(self) -> int:
        """Deliveries read and processed together (``settings.batch``, or the transport's
        ``batch_default``); 1: each message on its own."""
        if self.settings.batch is not None:
            return self.settings.batch
        default = getattr(self.transport, "batch_default", 1)
        return default if isinstance(default, int) and default > 0 else 1

    async def _read(self) -> None:
        if self.batch > 1:
            await self._read_batches()
            return
        failures = 0
        settings = self.settings
        while not self.stopping:
            # Wait for one free slot, then take all free ones; a stop asked while every slot is
            # busy ends the reading at once, so the shutdown grace starts then, not when a
            # handler happens to finish.
            if not await self._slot_or_stop():
                break
            free = 1
            while free < settings.concurrency and not self._slots.locked():
                await self._slots.acquire()
                free += 1
            try:
                deliveries = await self.transport.fetch(free, settings.poll)
                failures = 0
            except BrokerUnavailable as exc:
                deliveries = []
                failures += 1
                await self._pause(settings.reconnect.delay(failures), exc)
            for _ in range(free - len(deliveries)):
                self._slots.release()
            chains: dict[Hashable, list[Delivery]] = {}
            for delivery in deliveries:
                chains.setdefault(_group(delivery), []).append(delivery)
            for chain in chains.values():
                work = self._one(chain[0]) if len(chain) == 1 else self._in_order(chain)
                task = asyncio.create_task(work)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _unless_stopped(self, work: Awaitable[_T]) -> asyncio.Future[_T]:
        """Run ``work`` until it ends or a stop is asked, whichever comes first: its future,
        ended either way (cancelled, and that cancel waited for, when the stop came first)."""
        doing = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([doing, stopping], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            doing.cancel()  # cancelled itself: the work is not left running on its own
            raise
        finally:
            stopping.cancel()
        if not doing.done():
            doing.cancel()
            with contextlib.suppress(BaseException):
                await doing
        return doing

    async def _slot_or_stop(self) -> bool:
        """Take one slot (True), or give up once a stop is asked (False, no slot taken)."""
        if not self._slots.locked():
            await self._slots.acquire()  # free now: no wait, no race
            return True
        acquiring = await self._unless_stopped(self._slots.acquire())
        if acquiring.done() and not acquiring.cancelled() and self._stopping.is_set():
            self._slots.release()  # taken as the stop came: give it back
            return False
        return acquiring.done() and not acquiring.cancelled()

    async def _slot_or_ending(self, delivery: Delivery) -> bool:
        """Take one slot for ``delivery`` (True), or give up once it may not wait any more
        (False, no slot taken): a stop, or its partition revoked (Kafka), looked for every
        :data:`_WATCH_TICK` while every slot is busy."""
        if not self._slots.locked():
            await self._slots.acquire()  # free now: no wait, no race
            return True
        acquiring = asyncio.ensure_future(self._slots.acquire())
        try:
            while not acquiring.done() and not self._ending(delivery):
                await asyncio.wait([acquiring], timeout=_WATCH_TICK)
        except BaseException:
            acquiring.cancel()
            if acquiring.done() and not acquiring.cancelled():
                self._slots.release()  # taken as the cancel came: give it back
            raise
        if not acquiring.done():
            acquiring.cancel()
            with contextlib.suppress(BaseException):
                await acquiring
        if acquiring.cancelled():
            return False
        if self._ending(delivery):
            self._slots.release()  # taken as the stop (or the revocation) came: give it back
            return False
        return True

    async def _read_batches(self) -> None:
        """Read up to ``batch`` deliveries, run them through the inbox together, settle each
        as its group ends. The next batch is read as soon as deliveries are settled, up to
        ``batch`` unsettled in all: a slow handler holds up its own group (a Kafka partition,
        an SQS message), not the messages behind the others. The groups of every batch share
        ``concurrency``."""
        failures = 0
        settings = self.settings
        fetch = getattr(self.transport, "fetch_batch", None) or self.transport.fetch
        # A Processor of your own may not bound its batches together: one at a time.
        overlap = isinstance(self.processor, InboxProcessor)
        while not self.stopping:
            room = self.batch - self._unsettled
            if room < 1 or (self._unsettled and not overlap):
                self._room.clear()
                await self._unless_stopped(self._room.wait())  # a stop: _drain waits for them
                continue
            try:
                deliveries: list[Delivery] = await fetch(room, settings.poll)
                failures = 0
            except BrokerUnavailable as exc:
                failures += 1
                await self._pause(settings.reconnect.delay(failures), exc)
                continue
            if deliveries:
                self._unsettled += len(deliveries)
                task = asyncio.create_task(self._many(deliveries))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _done_with(self, count: int) -> None:
        """``count`` deliveries of a batch are settled (or given back): room for more."""
        self._unsettled -= count
        self._room.set()

    async def _pause(self, delay: timedelta, exc: BaseException) -> None:
        self._log.warning(
            "oncely broker=%s unavailable (%s); trying again in %.1fs",
            self.transport.name,
            exc,
            delay.total_seconds(),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay.total_seconds())

    async def _drain(self) -> None:
        self._draining = True  # the copies held (in_flight) are given back at once
        with contextlib.suppress(BrokerUnavailable):
            await self.transport.stop()
        if self._tasks:
            grace = self.settings.shutdown_grace.total_seconds()
            self._log.info(
                "oncely broker=%s stopping: waiting up to %gs for %d running handler task(s)",
                self.transport.name,
                grace,
                len(self._tasks),
            )
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            if pending:
                self._log.warning(
                    "oncely broker=%s the shutdown grace of %gs ran out: %d handler task(s) "
                    "cancelled; their claims are released (a finished handler's result kept) "
                    "and their messages given back for a redelivery",
                    self.transport.name,
                    grace,
                    len(pending),
                )
            for task in pending:  # cancelled handlers release their claims (the inbox does)
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    # ------------------------------------------------------------------ a batch

    async def _many(self, deliveries: list[Delivery]) -> None:
        left = dict(enumerate(deliveries))
        """The batch's deliveries not settled yet (groups that ended early are settled as
        they end)."""
        spans = self._spans
        if spans is not None:
            for delivery in deliveries:
                spans.start(delivery)
        try:
            await self._run_many(deliveries, left)
        finally:
            if spans is not None:
                spans.ended(
                    [d for d in deliveries if id(d) not in self._rerunning],
                    "given back unprocessed",
                )
            self._done_with(len(left))

    async def _run_many(self, deliveries: list[Delivery], left: dict[int, Delivery]) -> None:
        tickets = []
        every = self.transport.extend_every
        if every is not None:
            tickets = [
                self._heartbeats.start(functools.partial(self._extend, d), every.total_seconds())
                for d in deliveries
            ]

        async def early(indexes: list[int], outcomes: list[Handled[Any]]) -> None:
            mine = [(left.pop(i), handled) for i, handled in zip(indexes, outcomes, strict=True)]
            if tickets:
                for i in indexes:
                    await tickets[i].stop()
            try:
                await self._settle_all(mine)
            finally:
                self._done_with(len(mine))

        try:
            try:
                outcomes = await self._process_many(deliveries, early)
            finally:
                for ticket in tickets:
                    await ticket.stop()
        except asyncio.CancelledError:
            if not _cancelled():
                outcomes = [self._not_cancelled(d) for d in deliveries]
            else:
                back = list(left.values())
                await _by_group(
                    back,
                    lambda i: self._settle_quietly(
                        self._give_back(back[i], timedelta(0)), back[i], "retry"
                    ),
                )
                raise
        except Exception as exc:  # the store failed (StoreError) or a bug: never ack
            self.counts["store_unavailable"] += len(left)
            named = [self._named(d) for d in left.values()]
            said = self._said(exc, *(self._key_of(d) for d in left.values()))
            if self._spans is not None:
                for d in left.values():
                    self._spans.gave_back(
                        d, f"could not process the batch: {said}", exc, (self._key_of(d),)
                    )
            self._log.error(
                "oncely broker=%s could not process a batch of %d messages (%s); they are "
                "given back and will be redelivered keys=%s",
                self.transport.name,
                len(left),
                said,
                ",".join("None" if key is None else printable(key) for key, _ in named),
                extra={
                    "oncely_broker": self.transport.name,
                    "oncely_broker_action": "retry",
                    "oncely_keys": [key for key, _ in named],
                    "oncely_correlation_ids": [correlation_id for _, correlation_id in named],
                    "oncely_consumer": self.processor.consumer,
                    "oncely_reason": said,
                },
            )
            backoff = self.settings.backoff
            back = list(left.values())
            await _by_group(
                back,
                lambda i: self._settle_quietly(
                    self._give_back(back[i], backoff.delay(back[i].delivery_count)),
                    back[i],
                    "retry",
                ),
            )
            return
        rest = [(d, outcomes[i]) for i, d in left.items()]
        finished = await self._settle_all(rest)
        if len(rest) == len(deliveries):  # nothing settled early (the stored offsets' case)
            await self._store_past_dead_letters(deliveries, outcomes, finished)

    async def _settle_all(self, settled: list[tuple[Delivery, Handled[Any]]]) -> list[bool]:
        """Carry out each delivery's outcome; the acks in one call where the transport takes
        them so (SQS). Whether each is finished.

        ``settled`` comes in its source order. The outcomes of one ordering group (a Kafka
        partition, an SQS FIFO message group) are carried out one after the other in that
        order, the groups side by side: their dead-letter copies are written in the order
        of their messages (carried out at once, the copy of a later record could land
        before an earlier one's, and a user re-sending dead letters in order, or compacting
        the dead-letter topic by record key, would get them reordered)."""
        ack_many = getattr(self.transport, "ack_many", None)
        together = ack_many is not None
        finished = await _by_group(
            [d for d, _handled in settled],
            lambda i: self._settle(*settled[i], ack=not together),
        )
        acks = [d for d, h in settled if h.action is Action.ACK]
        if ack_many is not None and acks:  # one call for the batch's acks (SQS)
            try:
                await ack_many(acks)
            except Exception as exc:
                self._trace_acks(settled, done=False)
                self.counts["settle_failed"] += len(acks)
                self._log.warning(
                    "oncely broker=%s could not ack %d messages (%s); the broker redelivers them",
                    self.transport.name,
                    len(acks),
                    exc,
                )
            else:
                self._trace_acks(settled, done=True)
        return list(finished)

    def _trace_acks(self, settled: list[tuple[Delivery, Handled[Any]]], *, done: bool) -> None:
        """End the spans of the deliveries acknowledged together (``ack_many``)."""
        if self._spans is not None:
            for delivery, handled in settled:
                if handled.action is Action.ACK:
                    self._trace_settled(delivery, handled, "ack", None, done)

    async def _process_many(
        self, deliveries: list[Delivery], early: Early[Any] | None = None
    ) -> list[Handled[Any]]:
        """Each delivery's outcome: refused ones at once, the rest as one batch of the
        processor (or one message after the other, for a processor without batches). The
        two-phase processor tells ``early`` (indexes into ``deliveries``) the outcomes of
        groups that end while others still run."""
        outcomes: list[Handled[Any] | None] = [None] * len(deliveries)
        ready: list[int] = []
        envelopes: list[Envelope] = []
        for i, delivery in enumerate(deliveries):
            decoded = self._decoded(delivery)
            if isinstance(decoded, Envelope):
                ready.append(i)
                envelopes.append(decoded)
            else:
                outcomes[i] = decoded
        if envelopes:
            every = [_group(d) for d in deliveries]
            groups = [every[i] for i in ready]
            many = getattr(self.processor, "process_batch", None)
            concurrency = self.settings.concurrency
            by_group = {g: deliveries[i] for g, i in zip(groups, ready, strict=True)}

            def stop(group: Hashable) -> bool:
                return self._stopping.is_set() or _revoked(by_group[group])

            slots = self._slots  # shared by the batches running at once
            traced: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if self._spans is not None:
                key_of = getattr(self.processor, "key_of", None)
                if key_of is not None:  # an InboxProcessor's handlers run under their spans
                    traced = self._spans.batch(
                        [(key_of(envelopes[j]), deliveries[i]) for j, i in enumerate(ready)]
                    )
            with traced:
                if self._positions is not None:
                    positions = _positions(deliveries, every, outcomes)
                    done: list[Handled[Any]] = await _each(
                        self._positions,
                        envelopes,
                        groups,
                        concurrency,
                        stop,
                        [positions[i] for i in ready],
                        slots,
                    )
                elif isinstance(self.processor, InboxProcessor):
                    settled = None
                    if early is not None:
                        settled = _with_refused(early, ready, every, outcomes)

                    done = await self.processor.process_batch(
                        envelopes, groups, concurrency, stop, settled=settled, slots=slots
                    )
                elif many is not None:  # a Processor of your own (its batches one at a time)
                    done = await many(envelopes, groups, concurrency, stop)
                else:
                    done = await _each(
                        self.processor, envelopes, groups, concurrency, stop, None, slots
                    )
            for i, handled in zip(ready, done, strict=True):
                outcomes[i] = handled
        return [handled for handled in outcomes if handled is not None]

    # ------------------------------------------------------------------ one message

    async def _one(self, delivery: Delivery) -> None:
        await self._finish_one(delivery)

    async def _finish_one(self, delivery: Delivery) -> bool:
        """Process and settle one delivery, then free its slot; whether it is finished
        (acknowledged or its dead letter written) rather than given back."""
        spans = self._spans
        try:
            if spans is None:
                handled = await self._outcome(delivery)
            else:
                with spans.current(delivery):  # the handler's spans are its children
                    handled = await self._outcome(delivery)
            if handled is None:
                return False
            finished = await self._settle(delivery, handled)
            await self._store_past_dead_letters([delivery], [handled], [finished])
            return finished
        finally:
            if spans is not None:
                spans.ended([delivery], "given back unprocessed")
            self._slots.release()

    async def _in_order(self, chain: Sequence[Delivery]) -> None:
        """The deliveries of one ordering group that came in one read (an SQS FIFO message
        group), one after another as the broker handed them out, each holding its slot until
        it is settled and kept alive on the broker while it waits. Once one is not finished
        (it failed, met a running copy, the store was away) or a stop is asked, the later ones
        are given back unrun (``in_flight``): the broker hands them out again behind it, and
        the group's order holds. Cancelled (the shutdown grace ran out), the ones not started
        are given back at once."""
        every = self.transport.extend_every
        waiting = {
            id(d): self._heartbeats.start(functools.partial(self._extend, d), every.total_seconds())
            for d in chain[1:]
            if every is not None
        }
        held_back: str | None = None
        left = list(chain)
        try:
            while left:
                delivery = left[0]
                ticket = waiting.pop(id(delivery), None)
                if ticket is not None:
                    await ticket.stop()
                if held_back is None and self.stopping:
                    held_back = "not started: the consumer is stopping"
                if held_back is None:
                    left.pop(0)
                    if not await self._finish_one(delivery):
                        held_back = "held back: an earlier message of its group was not finished"
                    continue
                left.pop(0)
                try:
                    await self._settle(delivery, self._held_back(delivery, held_back))
                finally:
                    self._slots.release()
        except asyncio.CancelledError:
            for delivery in left:
                await self._settle_quietly(
                    self._give_back(delivery, timedelta(0)), delivery, "retry"
                )
                self._slots.release()
            raise
        finally:
            for ticket in waiting.values():
                await ticket.stop()

    def _held_back(self, delivery: Delivery, reason: str) -> Handled[Any]:
        """The ``in_flight`` outcome of a delivery not run behind an unfinished one."""
        return self._outcome_of(delivery, Outcome.IN_FLIGHT, reason)

    def _outcome_of(self, delivery: Delivery, outcome: Outcome, reason: str) -> Handled[Any]:
        """``outcome`` for a delivery the inbox gave no outcome of its own, keyed by its
        message id where that can be shown."""
        envelope = delivery.envelope
        message_id = envelope.message_id
        return Handled(
            outcome,
            self.processor.consumer,
            message_id if message_id and not escaped(message_id) else None,
            reason=reason,
            correlation_id=envelope.correlation_id,
        )

    async def _outcome(self, delivery: Delivery) -> Handled[Any] | None:
        """The delivery's outcome, kept alive on the broker while it is computed; ``None``
        when it could not be computed (the delivery was given back)."""
        ticket = None
        every = self.transport.extend_every
        if every is not None:  # a timer per delivery; a task only when an extension is due
            ticket = self._heartbeats.start(
                functools.partial(self._extend, delivery), every.total_seconds()
            )
        try:
            try:
                return await self._process(delivery)
            finally:
                if ticket is not None:
                    await ticket.stop()
        except asyncio.CancelledError:
            if not _cancelled():
                return self._not_cancelled(delivery)
            # Shutdown past the grace period: the inbox released the claim; give it back.
            await self._settle_quietly(self._give_back(delivery, timedelta(0)), delivery, "retry")
            raise
        except Exception as exc:  # the store failed (StoreError) or a bug: never ack
            self.counts["store_unavailable"] += 1
            self._could_not_process(delivery, exc)
            await self._settle_quietly(
                self._give_back(delivery, self.settings.backoff.delay(delivery.delivery_count)),
                delivery,
                "retry",
            )
            return None

    def _could_not_process(self, delivery: Delivery, exc: Exception) -> None:
        """Log a message given back without an outcome (the store failed) with its key and
        correlation id, as every message's line has them (R16)."""
        key, correlation_id = self._named(delivery)
        said = self._said(exc, self._key_of(delivery))
        transport = delivery.describe()
        if self._spans is not None:
            self._spans.gave_back(
                delivery, f"could not process the message: {said}", exc, (self._key_of(delivery),)
            )
        self._log.error(
            "oncely broker=%s could not process a message (%s); it is given back "
            "and will be redelivered key=%s correlation_id=%s%s",
            self.transport.name,
            said,
            None if key is None else printable(key),
            None if correlation_id is None else printable(correlation_id),
            _fields(transport),
            extra={
                "oncely_broker": self.transport.name,
                "oncely_broker_action": "retry",
                "oncely_key": key,
                "oncely_correlation_id": correlation_id,
                "oncely_consumer": self.processor.consumer,
                "oncely_deliveries": delivery.delivery_count,
                "oncely_transport": dict(transport),
                "oncely_reason": said,
            },
        )

    def _key_of(self, delivery: Delivery) -> str | None:
        """A delivery's key, as given (never to be logged as it is: see :meth:`_named`)."""
        envelope = delivery.envelope
        key_of = getattr(self.processor, "key_of", None)
        message_id = envelope.message_id
        if key_of is not None:
            return key_of(envelope)  # type: ignore[no-any-return]
        return message_id if message_id and not escaped(message_id) else None

    def _named(self, delivery: Delivery) -> tuple[str | None, str | None]:
        """The key (as this consumer's lines show keys) and the correlation id of a delivery
        that has no outcome to carry them."""
        key = self._key_of(delivery)
        return key_for_logs(key, self._log_keys), delivery.envelope.correlation_id

    def _told(self, handled: Handled[Any]) -> str | None:
        """An outcome's reason for a log line, its key shown as this consumer's lines show
        keys (a handler's error may name it)."""
        reason = handled.reason
        return reason and redact_keys(reason, (handled.key,), self._log_keys)

    def _said(self, exc: BaseException, *keys: str | None) -> str:
        """``Name: text`` of ``exc`` for a log line, the ``keys`` it may carry (a store's
        error names its key: a claim that kept racing, a lease lost) shown as this
        consumer's lines show keys."""
        return redact_keys(f"{type(exc).__name__}: {exc}", keys, self._log_keys)

    def _not_cancelled(self, delivery: Delivery) -> Handled[Any]:
        """The ``failed`` outcome of a delivery whose handler raised CancelledError while
        nobody cancelled the consumer (a cancellation that escaped a task or timeout of the
        handler's own). The inbox released its claim; given back as a shutdown's message is
        (at once, uncounted), it would come again and again without end, never reaching
        ``max_deliveries`` nor a log line. As a failure it is retried after the backoff and
        dead-lettered once its deliveries are spent."""
        return self._outcome_of(
            delivery,
            Outcome.FAILED,
            "the handler raised CancelledError, but the consumer was not cancelled (a "
            "cancellation of the handler's own escaped it)",
        )

    async def _extend(self, delivery: Delivery) -> None:
        try:
            await delivery.extend()
        except Exception as exc:
            self._log.warning("oncely could not extend a delivery's ack wait: %s", exc)

    async def _process(self, delivery: Delivery) -> Handled[Any]:
        decoded = self._decoded(delivery)
        if not isinstance(decoded, Envelope):
            return decoded
        if self._positions is not None:
            return await self._positions.process(decoded, position=_position(delivery))
        return await self.processor.process(decoded)

    def _decoded(self, delivery: Delivery) -> Envelope | Handled[Any]:
        """The delivery's message with its body decoded, or the ``rejected`` outcome of one
        that cannot be processed (refused by the transport, too large, undecodable)."""
        envelope = delivery.envelope
        refusal = delivery.refusal
        if refusal is None:
            limit = self.settings.max_body_bytes
            size = _size(envelope.body)
            if limit is not None and size > limit:
                refusal = (
                    f"the body is {size} bytes, over the limit of {limit} "
                    "(ConsumerSettings.max_body_bytes, oncely consume --max-body-bytes); it "
                    "was not decoded"
                )
            else:
                try:
                    return replace(envelope, body=self._decode(envelope))
                except Exception as exc:
                    refusal = f"undecodable body: {exc}"
        message_id = envelope.message_id
        return self.processor.refuse(
            refusal,
            key=message_id if message_id and not escaped(message_id) else None,
            correlation_id=envelope.correlation_id,
        )

    def _give_back(self, delivery: Delivery, delay: timedelta) -> Awaitable[None]:
        """:func:`_give_back`, noted where the broker counts the delivery it makes: the
        message's later failures are counted without it."""
        if delivery.delivery_count is not None and getattr(delivery, "requeue", None) is None:
            self._given_back.note(_identity(delivery))
        return _give_back(delivery, delay)

    def _hold_or_give_back(self, delivery: Delivery, handled: Handled[Any]) -> Awaitable[None]:
        """The broker action of an ``in_flight`` copy, which waits for
        :func:`_in_flight_delay`: held here meanwhile and its key's record watched
        (:meth:`_watch`) where the key is held under a lease, the inbox's store can be read
        and the consumer goes on; else given back at once for a delivery after that wait."""
        delay = _in_flight_delay(handled, self.settings.requeue_delay)
        record = handled.record
        if (
            record is None
            and getattr(delivery, "group", None) is not None
            and isinstance(self.processor, InboxProcessor)
        ):
            # Held back behind an unfinished message of its ordering group (the inbox's
            # in_flight always names the record it met, else): the broker hands out nothing
            # of the group while that one is out (a Kafka partition's run, an SQS FIFO group
            # with a message in flight), nor anything of it ahead of that one after. A wait
            # of its own would only hold the group up once that one is finished (a held copy
            # resolved as soon as its key's holder ended).
            delay = timedelta(0)
        inbox = getattr(self.processor, "inbox", None)
        if record is None or record.status is not Status.IN_PROGRESS:
            return self._give_back(delivery, delay)
        if not isinstance(inbox, AsyncInbox):  # a Processor of your own: no record to watch
            return self._give_back(delivery, delay)
        if self._ending(delivery):
            # The stop (or the revocation) waits for no lease: the next consumer to get the
            # copy watches it in turn.
            return self._give_back(delivery, timedelta(0))
        return self._start_watch(delivery, inbox, record, delay)

    @property
    def _most_watched(self) -> int:
        """How many ``in_flight`` copies are held at once, at most: as many as the consumer
        reads ahead (the prefetch it opens the transport with). A watch holds no slot, so
        the consumer goes on reading while it waits, and a broker that hands out new
        messages whatever a consumer holds (Redis Streams, SQS) would otherwise have every
        copy of a key held elsewhere held here, each reading the store and kept alive."""
        return max(self.settings.concurrency, self.batch)

    async def _start_watch(
        self, delivery: Delivery, inbox: AsyncInbox, record: Record, delay: timedelta
    ) -> None:
        if len(self._watching) >= self._most_watched:
            await self._give_back(delivery, delay)  # as before watches: after the wait
            return
        task = asyncio.create_task(self._watch(delivery, inbox, record, delay))
        self._watching.add(task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._watching.discard)

    def _ending(self, delivery: Delivery) -> bool:
        """Whether nothing more of ``delivery`` may wait here: the consumer is stopping, or
        its partition was taken away (Kafka)."""
        return self.stopping or self._draining or _revoked(delivery)

    async def _watch(
        self, delivery: Delivery, inbox: AsyncInbox, record: Record, delay: timedelta
    ) -> None:
        """Hold an ``in_flight`` copy (kept alive on the broker) for up to ``delay``, what is
        left of the lease it met, looking at its key's record meanwhile (:meth:`_freed`).
        Once the record has changed (completed, released, taken over, its lease lapsed), the
        copy goes through the inbox again at once, on this very delivery: a ``duplicate``
        (acked) once the holder completed, run once it released, ``in_flight`` again (and
        watched again) if another worker took it. Still held by the same claim at the end of
        ``delay``, it is given back then, for a delivery at once (the wait is done); the
        consumer stopping, or its partition revoked, gives it back at once too, so the stop
        waits for no lease (the next consumer to get it watches it in turn)."""
        every = self.transport.extend_every
        ticket = None
        if every is not None:
            ticket = self._heartbeats.start(
                functools.partial(self._extend, delivery), every.total_seconds()
            )
        elif not _keeps_order(delivery):
            # Nothing keeps it alive (RabbitMQ): held at most half the broker's ack wait, as
            # the transport holds a message it gives back later, past which the broker would
            # close the channel and give back every message on it.
            ack_wait = self._limits().ack_wait
            if ack_wait is not None and ack_wait > timedelta(0):
                delay = min(delay, ack_wait / 2)
        end = time.monotonic() + delay.total_seconds()
        rerun = False
        settling = False  # given back already: a cancel then must not give it back again
        try:
            try:
                freed = await self._freed(delivery, inbox, record, end)
                # Kept alive while it waits for a slot to run in, too.
                slot = freed and not self._ending(delivery) and await self._slot_or_ending(delivery)
            finally:
                # No longer watched: a rerun met by another claim may be watched again.
                self._watching.discard(cast("asyncio.Task[None]", asyncio.current_task()))
                if ticket is not None:
                    await ticket.stop()
            if slot:
                if self._ending(delivery):  # revoked while it waited for a slot
                    self._slots.release()
                    settling = True
                    await self._settle_quietly(
                        self._give_back(delivery, timedelta(0)), delivery, "retry"
                    )
                    return
                rerun = True
                self._rerunning.add(id(delivery))
                try:
                    await self._finish_one(delivery)  # frees the slot
                finally:
                    self._rerunning.discard(id(delivery))
                return
            settling = True
            await self._settle_quietly(self._give_back(delivery, timedelta(0)), delivery, "retry")
        except asyncio.CancelledError:
            # A rerun cancelled gives its delivery back itself (_outcome); a give-back cut
            # short by the cancel is not made twice (a second nack of one delivery tag
            # closes a RabbitMQ channel, giving back every message on it).
            if not rerun and not settling:
                await self._settle_quietly(
                    self._give_back(delivery, timedelta(0)), delivery, "retry"
                )
            raise

    async def _freed(
        self, delivery: Delivery, inbox: AsyncInbox, record: Record, end: float
    ) -> bool:
        """Whether the key held under ``record`` was freed before ``end`` (monotonic), or at
        it: its record looked at after :data:`_WATCH_FIRST`, then less and less often (up to
        every :data:`_WATCH_MOST`), one read each time, and once more at ``end``. False
        when it is still held then, or as soon as the copy may not wait (a stop, a
        revocation: looked for every :data:`_WATCH_TICK`). A store that fails to answer
        is taken as no change (logged once)."""
        pause = _WATCH_FIRST
        look = time.monotonic() + pause
        told = False
        while not self._ending(delivery):
            now = time.monotonic()
            if now >= look or now >= end:
                # A stop wins over a store slow to answer: the copy is given back at once.
                reading = await self._unless_stopped(inbox.get(record.key))
                if reading.cancelled():
                    return False
                try:
                    if _freed(reading.result(), record, at_end=now >= end):
                        return True
                except Exception as exc:
                    if not told:
                        told = True
                        self._log.warning(
                            "oncely broker=%s could not look at the record of a key held "
                            "elsewhere (%s); its copy waits for what is left of the lease",
                            self.transport.name,
                            self._said(exc, record.key),
                        )
                if now >= end:
                    return False
                pause = min(pause * 2, _WATCH_MOST)
                look = time.monotonic() + pause
            now = time.monotonic()
            await asyncio.sleep(max(0.0, min(_WATCH_TICK, look - now, end - now)))
        return False

    def _failures(self, delivery: Delivery, count: int) -> tuple[int, int]:
        """How many of the message's ``count`` deliveries failed, this one included, and how
        many this process gave back unrun (never more than ``count - 1``)."""
        if not self._given_back:
            return count, 0
        return self._given_back.failures(_identity(delivery), count)

    def _finished(self, delivery: Delivery) -> None:
        """The message is acknowledged or dead-lettered: its give-backs are forgotten."""
        if self._given_back:
            self._given_back.forget(_identity(delivery))

    async def _settle(self, delivery: Delivery, handled: Handled[Any], *, ack: bool = True) -> bool:
        """Count, log and carry out the outcome's broker action; with ``ack=False`` an ack is
        left to the caller (a batch's acks go in one call). Whether the delivery is finished:
        acknowledged (or left to the caller to), or its dead-letter copy written.

        A failure is retried until the message has failed ``max_deliveries`` times: the
        broker's delivery count less the give-backs this process made of it (deliveries that
        ran no handler). A give-back made by another process, or before a restart, is not
        known here and counts as a failure, as every delivery did before: a message is
        dead-lettered early then, never retried beyond ``max_deliveries`` failures."""
        self.counts[handled.outcome.value] += 1
        settings = self.settings
        action = handled.action
        count = delivery.delivery_count
        if handled.attempt and getattr(self.transport, "local_delivery_counts", False):
            # The broker counts no deliveries (Kafka): the transport's count is this
            # process's own; the inbox's attempt count is higher when a claim was taken over
            # (a failure releases its claim, so failures are counted by the transport alone).
            count = max(count or 0, handled.attempt)
        failures, given_back = (count, 0)
        if action is Action.RETRY and count is not None:
            failures, given_back = self._failures(delivery, count)
        step: Awaitable[None] | None
        after_retries = False
        dead_reason: str | None = None
        if action is Action.ACK:
            step, how = (delivery.ack() if ack else None), "ack"
        elif action is Action.REQUEUE_LATER:
            step, how = self._hold_or_give_back(delivery, handled), "requeue"
        elif action is Action.RETRY and (failures is None or failures < settings.max_deliveries):
            step, how = delivery.retry(settings.backoff.delay(failures)), "retry"
        else:
            reason = handled.reason or handled.outcome.value
            outcome = handled.outcome.value
            if action is Action.RETRY:
                outcome = Outcome.REJECTED.value
                reason = failed_reason(failures or 0, count or 0, given_back, reason)
                after_retries = True
            why = DeadLetter(
                outcome=outcome, reason=reason, consumer=self.processor.consumer, deliveries=count
            )
            dead_reason = reason
            step, how = delivery.dead_letter(why), "dead_letter"
        level = logging.ERROR if how == "dead_letter" else handled.log_level
        if self._log.isEnabledFor(level):
            transport = delivery.describe()
            key = key_for_logs(handled.key, self._log_keys)
            correlation_id = handled.correlation_id
            self._log.log(
                level,
                "oncely broker=%s outcome=%s action=%s key=%s correlation_id=%s deliveries=%s%s%s",
                self.transport.name,
                handled.outcome.value,
                how,
                None if key is None else printable(key),
                None if correlation_id is None else printable(correlation_id),
                count,
                _fields(transport),
                f" reason={printable(shown)}" if (shown := self._told(handled)) else "",
                extra={
                    "oncely_broker": self.transport.name,
                    "oncely_outcome": handled.outcome.value,
                    "oncely_broker_action": how,
                    "oncely_key": key,
                    "oncely_correlation_id": correlation_id,
                    "oncely_consumer": handled.consumer,
                    "oncely_deliveries": count,
                    "oncely_transport": dict(transport),
                    "oncely_reason": shown,
                },
            )
        done = step is None or await self._settle_quietly(step, delivery, how)
        # An ack left to the caller (ack_many) ends its span there, once it is carried out.
        self._trace_settled(delivery, handled, how, dead_reason, None if step is None else done)
        if done and how in ("ack", "dead_letter"):
            self._finished(delivery)
        if how == "dead_letter":
            # Counted once the copy is written: a copy that failed gave the message back
            # (it is read again, and its outcome decided anew), it dead-lettered nothing.
            if not done:
                self.counts["dead_letter_failed"] += 1
            elif after_retries:
                self.counts["dead_lettered_after_retries"] += 1
                # The hooks heard each failed delivery; the message's end is this rejection,
                # as its dead letter says (x-oncely-outcome): a metric of dead letters needs it.
                told = getattr(self.processor, "dead_lettered", None)
                if told is not None:
                    try:
                        told(replace(handled, outcome=Outcome.REJECTED, reason=why.reason))
                    except Exception as exc:
                        log_error(
                            self._log, logging.ERROR,
                            "oncely could not tell the hooks of a dead letter", error=exc,
                            keys=(handled.key,), mode=self._log_keys,
                        )  # fmt: skip
        return done and how in ("ack", "dead_letter")

    def _trace_settled(
        self,
        delivery: Delivery,
        handled: Handled[Any],
        how: str,
        reason: str | None,
        done: bool | None,
    ) -> None:
        """End the delivery's span (with tracing) with its outcome and broker action, and
        whether that was ``done`` (None: not yet, left to the caller). The broker action is
        taken already: a tracing failure is logged, never the message's."""
        if self._spans is not None and done is not None:
            try:
                self._spans.settled(delivery, handled, how, reason=reason, carried_out=done)
            except Exception:
                self._log.exception("oncely broker=%s could not end a span", self.transport.name)

    async def _settle_quietly(self, step: Awaitable[None], delivery: Delivery, how: str) -> bool:
        """Await the broker action ``step``; whether it was carried out (a failure is counted
        and logged, never raised)."""
        try:
            await step
        except Exception as exc:
            # The broker will redeliver (the connection is gone or the tag is stale); the
            # inbox answers the redelivery as a duplicate if the message was processed.
            self.counts["settle_failed"] += 1
            self._log.warning(
                "oncely broker=%s could not %s a message (%s); the broker redelivers it%s",
                self.transport.name,
                how,
                exc,
                _fields(delivery.describe()),
            )
            return False
        return True

    async def _store_past_dead_letters(
        self,
        deliveries: Sequence[Delivery],
        outcomes: Sequence[Handled[Any]],
        finished: Sequence[bool],
    ) -> None:
        """With ``store_offsets``: once dead letters are written, store how far each group
        (partition) got, in a transaction of its own, as for a duplicate. A dead letter's
        position is never written before its copy is confirmed (no handler's transaction
        carried it, and the records after it in its group wrote none), so a group whose
        Kafka commits were lost would read it, and dead-letter it, again. The position
        stored is the end of the group's run of finished deliveries from the start of the
        batch, where that run holds one that did not store its own (a dead letter);
        nothing of a group whose first delivery is not finished."""
        positions = self._positions
        if positions is None:
            return
        ends: dict[Hashable, Position] = {}
        behind: set[Hashable] = set()  # the run holds a delivery with no position of its own
        stopped: set[Hashable] = set()
        for delivery, handled, done in zip(deliveries, outcomes, finished, strict=True):
            group = _group(delivery)
            if group in stopped:
                continue
            position = _position(delivery)
            if not done or position is None:
                stopped.add(group)
                continue
            ends[group] = position
            if handled.outcome not in _FINISHED_HERE:
                behind.add(group)
        for group in behind:
            try:
                await positions.save_position(ends[group])
            except Exception as exc:
                # The copy is written and the broker's commit moves past it: only a group
                # that lost its commits would read (and dead-letter) it again.
                self.counts["offset_not_stored"] += 1
                self._log.warning(
                    "oncely broker=%s could not store the offset %s of partition %s of %s "
                    "after a dead letter (%s: %s)",
                    self.transport.name,
                    ends[group][2],
                    ends[group][1],
                    ends[group][0],
                    type(exc).__name__,
                    exc,
                )


_HOLD_AT_MOST = timedelta(minutes=5)
"""The longest an in_flight copy waits for another worker's lease in one go (a broker may
close a consumer that holds a message unacknowledged for much longer: RabbitMQ after 30 min).
It is resolved sooner once the key's record changes (:meth:`BrokerConsumer._watch`)."""

_WATCH_FIRST = 0.05
"""Seconds before the first look at the record of a key an in_flight copy met; each pause
after is twice the one before, up to :data:`_WATCH_MOST`."""
_WATCH_MOST = 1.5
"""The longest pause between two looks at a held key's record: one store read per held copy
every 1.5 s at most, once the first few are done."""
_WATCH_TICK = 0.05
"""How often a held copy checks that it may still wait (a stop, a revoked partition), without
reading the store."""


def _freed(found: Record | None, held: Record, *, at_end: bool) -> bool:
    """Whether the key ``held`` was claimed under is free of that claim now (``found``: its
    record as read): gone (released, forgotten), ended (completed, failed), taken by another
    claim (another worker took over a lapsed lease), or, at the end of the wait (``at_end``),
    its lease lapsed. A lease is taken for lapsed by the end of the wait only, as the wait was
    reckoned from it: a clock that runs ahead of the store's does not make the copy claim
    again and again before then."""
    if found is None or found.status is not Status.IN_PROGRESS or found.token != held.token:
        return True
    return at_end and found.lease_until_ms <= time.time() * 1000


def _identity(delivery: Delivery) -> Hashable | None:
    """What tells the message apart from every other on its broker, the same on each of its
    deliveries: the delivery's ``identity`` where the transport offers one (a JetStream
    stream sequence, a Redis Streams entry id, an SQS ``MessageId``), else a digest of its
    message id and body (two copies a producer sent with one id and body are taken for one
    message). ``None`` for a body that is no bytes."""
    identity = getattr(delivery, "identity", None)
    if identity is not None:
        return cast(Hashable, identity)
    envelope = delivery.envelope
    body = envelope.body
    if not isinstance(body, bytes | bytearray | memoryview):
        return None
    digest = hashlib.blake2b(body, digest_size=16)
    digest.update(b"\0" + (envelope.message_id or "").encode("utf-8", "surrogatepass"))
    return digest.digest()


def _give_back(delivery: Delivery, delay: timedelta) -> Awaitable[None]:
    """Give ``delivery`` back for a later delivery without counting one: its handler did not
    run to a failure (held back behind one, meeting a running copy, the store away, the
    shutdown). A transport that counts deliveries itself (Kafka) has ``requeue`` for it; a
    broker's own count (RabbitMQ, SQS, NATS, Redis Streams) moves anyway, so the consumer
    notes the give-back (:meth:`BrokerConsumer._give_back`) and takes it off that count
    before comparing it with ``max_deliveries``."""
    requeue = getattr(delivery, "requeue", None)
    return requeue(delay) if requeue is not None else delivery.retry(delay)


def _in_flight_delay(handled: Handled[Any], floor: timedelta) -> timedelta:
    """How long an ``in_flight`` copy waits before it is given back: ``floor``
    (``requeue_delay``), or what is left of the lease the key is held under, where that is
    longer (up to :data:`_HOLD_AT_MOST`). A copy given back every second while a dead worker's
    30 s lease runs out would spend a delivery each time, and reach the broker's delivery
    limit (RabbitMQ's, NATS's ``max_deliver``) before the key is free: dead-lettered by the
    broker, with no reason, never run. The wait is a bound, not a sentence: a copy that met a
    lease is held by the consumer meanwhile, its key's record watched, and goes through the
    inbox again as soon as the holder ends (:meth:`BrokerConsumer._watch`)."""
    record = handled.record
    if record is None or record.status is not Status.IN_PROGRESS:
        return floor
    left = timedelta(milliseconds=record.lease_until_ms - time.time() * 1000 + 100)
    return max(floor, min(left, _HOLD_AT_MOST))


def _position(delivery: Delivery) -> Position | None:
    """Where the delivery sits in its stream (a Kafka record: topic, partition, next
    offset), or None."""
    position = getattr(delivery, "position", None)
    return position if isinstance(position, tuple) else None


def _positions(
    deliveries: Sequence[Delivery],
    groups: Sequence[Hashable],
    refused: Sequence[Handled[Any] | None],
) -> list[Position | None]:
    """Each delivery's position to write with it: none after a delivery of its group that was
    refused before processing (its dead letter is still to be copied)."""
    stopped: set[Hashable] = set()
    out: list[Position | None] = []
    for delivery, group, outcome in zip(deliveries, groups, refused, strict=True):
        if outcome is not None:
            stopped.add(group)
        out.append(None if group in stopped else _position(delivery))
    return out


def _keeps_order(delivery: Delivery) -> bool:
    """Whether the delivery's transport keeps its group in order by itself, counting no
    delivery for a give-back (a Kafka partition: ``requeue``)."""
    return (
        getattr(delivery, "requeue", None) is not None
        and getattr(delivery, "group", None) is not None
    )


def _cancelled() -> bool:
    """Whether the running task was cancelled (a CancelledError that is not the handler's
    own)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _revoked(delivery: Delivery) -> bool:
    """Whether the delivery's partition was taken from this consumer (Kafka)."""
    return getattr(delivery, "revoked", False) is True


def _with_refused(
    early: Early[Any],
    ready: Sequence[int],
    groups: Sequence[Hashable],
    outcomes: Sequence[Handled[Any] | None],
) -> Early[Any]:
    """What tells ``early`` (indexes into the batch's deliveries) the outcomes of the groups
    that end while others run, told with indexes into ``ready`` (the deliveries processed).
    The deliveries of those groups refused before processing (``outcomes``) come with them,
    all in source order: a refused delivery left for the end of the batch would have its
    dead letter written after those of the later deliveries of its group."""
    refused: dict[Hashable, list[int]] = {}
    for i, outcome in enumerate(outcomes):
        if outcome is not None:
            refused.setdefault(groups[i], []).append(i)

    async def settled(indexes: list[int], ended: list[Handled[Any]]) -> None:
        told = {ready[j]: handled for j, handled in zip(indexes, ended, strict=True)}
        for i in list(told):
            for r in refused.pop(groups[i], ()):
                told[r] = cast("Handled[Any]", outcomes[r])
        order = sorted(told)
        await early(order, [told[i] for i in order])

    return settled


async def _by_group(
    deliveries: Sequence[Delivery], step: Callable[[int], Awaitable[_T]]
) -> list[_T]:
    """``step(i)`` for each of ``deliveries`` (in their source order): those of one ordering
    group (:func:`_group`) one after the other in that order, the groups side by side. What
    each step returned, in the deliveries' order."""
    chains: dict[Hashable, list[int]] = {}
    for i, delivery in enumerate(deliveries):
        chains.setdefault(_group(delivery), []).append(i)
    if len(chains) == len(deliveries):  # no two of one group: all at once
        return list(await asyncio.gather(*(step(i) for i in range(len(deliveries)))))
    done: dict[int, _T] = {}

    async def chain(indexes: list[int]) -> None:
        for i in indexes:
            done[i] = await step(i)

    await asyncio.gather(*(chain(indexes) for indexes in chains.values()))
    return [done[i] for i in range(len(deliveries))]


def _group(delivery: Delivery) -> Hashable:
    """The delivery's ordering group (a Kafka partition, an SQS FIFO message group); a
    delivery without one is a group of its own."""
    group = getattr(delivery, "group", None)
    return group if group is not None else object()


def _destination(transport: Transport) -> str:
    """The queue, stream, subject or topic ``transport`` reads, for its spans."""
    for name in ("source", "queue", "stream"):
        found = getattr(transport, name, None)
        if isinstance(found, str) and found:
            return found
    return transport.name


def _size(body: object) -> int:
    if isinstance(body, bytes | bytearray):
        return len(body)
    if isinstance(body, memoryview):
        return body.nbytes
    return 0  # a transport that hands out decoded bodies has no wire size to cap


def _name(handler: object) -> str:
    return getattr(handler, "__qualname__", None) or repr(handler)


def _fields(fields: Mapping[str, object]) -> str:
    return "".join(f" {printable(name)}={printable(str(value))}" for name, value in fields.items())
