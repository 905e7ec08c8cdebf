"""The middleware: the claim around a subscriber's handler, and the outcome's settlement."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Mapping
from dataclasses import replace
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal, NoReturn

try:
    from fast_depends.exceptions import ValidationError as BindingError
    from faststream import BaseMiddleware, Context
    from faststream.exceptions import AckMessage, RejectMessage
    from faststream.middlewares import AckPolicy
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.faststream needs FastStream: pip install 'oncely[faststream]'"
    ) from exc

from oncely._core.context import current
from oncely._core.observe import key_for_logs, redact_keys
from oncely._core.outcomes import Action, Handled, Outcome, Released
from oncely._core.said import said
from oncely.brokers._consumer import decode_body
from oncely.brokers._give_backs import GiveBacks, failed_reason
from oncely.brokers._shape import Backoff, DeadLetter
from oncely.errors import (
    ConfigurationError,
    MissingKey,
    Reject,
    ResultUnavailable,
    SchemaError,
    StoreUnavailable,
)
from oncely.inbox.async_inbox import AsyncInbox
from oncely.integrations._startup import EXIT_USAGE, stopping
from oncely.integrations._startup import LOGGER as STARTUP_LOGGER
from oncely.integrations._task_keys import first_result
from oncely.integrations.faststream._adapter import (
    ADAPTED,
    DEAD_LETTER_SUFFIX,
    Adapter,
    Settling,
    adapter_for,
)
from oncely.keys import BusinessKey, Envelope, FirstOf, KeySource, MessageIdKey
from oncely.wire import printable

__all__ = ["DEAD_LETTER_SUFFIX", "Idempotency"]

LOGGER = logging.getLogger("oncely.faststream")
_DEAD_LETTER_RETRY = timedelta(seconds=5)
_RESULT_IDS = uuid.UUID("6f6e6365-6c79-4e00-8000-666173747374")
_NOT_RUN = "oncely: not run by faststream run"
"""``worker_id`` of :meth:`Idempotency.prepare` when FastStream's runner did not call it."""


class Idempotency:
    """The broker middleware (see :mod:`oncely.integrations.faststream`): pass it to the
    broker, ``RabbitBroker(url, middlewares=[Idempotency(inbox)])``, or to
    ``include_router(router, middlewares=[...])``.

    ``inbox``: one inbox for every subscriber, or ``{name: inbox}`` keyed by the queue
    (RabbitMQ), subject (NATS), stream (Redis) or topic (Kafka) a subscriber reads (the
    others pass through untouched). ``key``: the key source (default: the producer's message id). A
    failed message is retried after ``backoff`` until it has failed ``max_deliveries``
    times, then dead-lettered with the number of failures; an ``in_flight`` copy is given
    back after ``requeue_delay``, which is no failure (where the broker counts it as a
    delivery, JetStream, the give-backs this process made are taken off its count; one made
    by another process, or before a restart, counts as a failure). A run that never finished
    (its worker died) is one of those runs too: once ``max_deliveries`` runs have begun, the
    last of them never finishing, the message is dead-lettered instead of run again."""

    def __init__(
        self,
        inbox: AsyncInbox | Mapping[str, AsyncInbox],
        *,
        key: KeySource | None = None,
        max_deliveries: int = 5,
        backoff: Backoff | None = None,
        requeue_delay: timedelta = timedelta(seconds=1),
        trust_hex_message_ids: bool = False,
    ) -> None:
        if not isinstance(inbox, AsyncInbox | Mapping):
            raise TypeError(
                "Idempotency takes an oncely.AsyncInbox (FastStream handlers are async) or a "
                f"mapping of queue, subject, stream or topic names to them, not "
                f"{type(inbox).__name__}"
            )
        inboxes = {"": inbox} if isinstance(inbox, AsyncInbox) else dict(inbox)
        for name, each in inboxes.items():
            if not isinstance(each, AsyncInbox):
                raise TypeError(
                    f"Idempotency takes an oncely.AsyncInbox (FastStream handlers are async), "
                    f"not {type(each).__name__}" + (f" for {name!r}" if name else "")
                )
        if max_deliveries < 1:
            raise ConfigurationError("max_deliveries must be at least 1")
        if requeue_delay < timedelta(0):
            raise ConfigurationError("requeue_delay must not be negative")
        self._every = inboxes.get("") if isinstance(inbox, AsyncInbox) else None
        self._inboxes = inboxes
        self._key = key if key is not None else MessageIdKey()
        self._body_key = _reads_body(self._key)
        self.max_deliveries = max_deliveries
        self.backoff = backoff if backoff is not None else Backoff()
        self.requeue_delay = requeue_delay
        self.trust_hex_message_ids = trust_hex_message_ids
        self._adapters: dict[type, Adapter | None] = {}
        self._held: set[asyncio.Task[None]] = set()
        self._given_back = GiveBacks()
        """The give-backs this process made of each unfinished message where its broker
        counts them as deliveries (JetStream): taken off the count, which then counts
        failures, before it is compared with ``max_deliveries``."""

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        return _Scope(self, msg, context=context)

    async def prepare(
        self,
        app: Any = Context("app", default=None),  # noqa: B008
        worker_id: Any = _NOT_RUN,
    ) -> None:
        """Connect every inbox's store and check its schema now, not at the first message.
        FastStream gives a broker middleware no start-up of its own: give this to the app,
        ``FastStream(broker, on_startup=[idempotency.prepare])``. Without it, an app whose
        store is down starts and gives every message back to the broker until the store
        answers.

        Run so by ``faststream run`` (which gives start-up hooks ``worker_id``), an app whose
        store is down does not start: one line on stderr names the store and the process
        exits with the status ``oncely consume`` uses, 3 (4 for tables this oncely cannot
        use). As the app's hook it is also given the app (``app``), and an app with a
        subscriber behind this middleware that it cannot protect (``AckPolicy.ACK_FIRST``,
        Kafka's default, and the kinds the module docstring lists) does not start either,
        with one line saying what to change and status 2: it would take each message off
        the broker and drop it unprocessed. Awaited in any other way (FastStream's
        ``TestApp``, a direct call), it raises instead: :class:`~oncely.StoreUnavailable`,
        :class:`~oncely.SchemaError`, :class:`~oncely.ConfigurationError`."""
        consumer = ""
        try:
            self._check_subscribers(app)
            seen: set[int] = set()
            for inbox in self._inboxes.values():
                if id(inbox.store) not in seen:
                    seen.add(id(inbox.store))
                    consumer = inbox.consumer
                    await inbox.prepare()
        except (StoreUnavailable, SchemaError) as exc:
            if worker_id == _NOT_RUN:
                raise
            await _exit(stopping("faststream", consumer, exc), worker_id)
        except ConfigurationError as exc:
            if worker_id == _NOT_RUN:
                raise
            STARTUP_LOGGER.error(
                "oncely faststream: the worker stops before taking a message: %s [exit %d]",
                exc,
                EXIT_USAGE,
            )
            await _exit(EXIT_USAGE, worker_id)

    def _check_subscribers(self, app: Any) -> None:
        refused = []
        for broker in getattr(app, "brokers", None) or ():
            for subscriber in getattr(broker, "subscribers", ()):
                if self not in getattr(subscriber, "_broker_middlewares", ()):
                    continue
                adapter = self._adapter(subscriber)
                source = None if adapter is None else adapter.source_of(subscriber)
                if self._inbox_for(source) is None or _dead_letters(source):
                    continue
                shown = source if source is not None else f"<a {type(subscriber).__name__}>"
                why = _refusal(adapter, subscriber, shown)
                if why is not None:
                    refused.append(why)
        if refused:
            raise ConfigurationError(
                "the app does not start: " + "; ".join(refused) + " (its messages would be "
                "taken off the broker and dropped unprocessed)"
            )

    def _shown_key(self, queue: str | None, key: str) -> str:
        """``key`` as the inbox of ``queue`` shows keys in its log lines."""
        inbox = self._inbox_for(queue)
        return key_for_logs(key, inbox.log_keys if inbox is not None else "plain") or ""

    def _inbox_for(self, queue: str | None) -> AsyncInbox | None:
        if self._every is not None:
            return self._every
        return None if queue is None else self._inboxes.get(queue)

    def _read_key(self, envelope: Envelope) -> str:
        if self._body_key:
            try:
                envelope = replace(envelope, body=decode_body(envelope))
            except Exception as exc:
                raise MissingKey(
                    f"the key is read from the body, which does not decode: {exc}"
                ) from None
        return self._key(envelope)

    def _adapter(self, subscriber: object) -> Adapter | None:
        kind = type(subscriber)
        if kind not in self._adapters:
            self._adapters[kind] = adapter_for(subscriber)
        return self._adapters[kind]

    async def _consume(
        self, scope: _Scope, call_next: Callable[[Any], Awaitable[Any]], msg: Any
    ) -> Any:
        subscriber = scope.context.get("handler_")
        raw: Any = getattr(msg, "raw_message", None)
        adapter = self._adapter(subscriber)
        source = None if adapter is None else adapter.source_of(subscriber)
        inbox = self._inbox_for(source)
        if inbox is None or _dead_letters(source):
            return await call_next(msg)
        if source is None:  # one inbox for all, and a subscriber of a broker not adapted
            source = f"<a {type(subscriber).__name__}>"
        adapter = _protectable(adapter, subscriber, raw, source)
        held = Settling(msg, raw, source, subscriber, scope.context.get("broker"), self._later)
        try:
            delivery = await adapter.read(msg, trust_hex=self.trust_hex_message_ids)
        except Exception as exc:  # the broker cannot say what it delivered: given back
            LOGGER.error(
                "oncely faststream source=%s could not read a message (%s: %s); it is given "
                "back and will be redelivered",
                source,
                type(exc).__name__,
                exc,
            )
            await self._give_back(adapter, held, self.backoff.delay(None))
            raise AckMessage() from None
        scope.adapter, scope.held = adapter, held
        scope.deliveries = delivery.envelope.delivery_count
        every = adapter.extend_every(held)

        async def run(_body: object) -> Any:
            try:
                await msg.decode()
            except Exception as exc:
                raise Reject(f"undecodable body: {exc!r}") from None
            try:
                if every is None:
                    return await call_next(msg)
                async with _kept(adapter, held, every):
                    return await call_next(msg)
            except AckMessage:  # the handler ended it as done: the key is complete
                return None
            except RejectMessage:  # the handler refused it: poison, dead-lettered
                raise Reject("the handler raised FastStream's RejectMessage") from None
            except Exception as exc:  # NackMessage included: released, retried
                if _binding(exc):
                    raise Reject(f"the body does not fit the handler's arguments: {exc}") from None
                raise

        try:
            if delivery.refusal is not None:
                handled: Handled[Any] = inbox.refuse(
                    delivery.refusal, correlation_id=delivery.envelope.correlation_id
                )
            else:
                handled = await inbox.handle_message(
                    delivery.envelope,
                    self._unless_unfinished(run, adapter, held, delivery.envelope),
                    key=self._read_key,
                )
        except Exception as exc:  # the store failed: given back, never run unprotected
            count = delivery.envelope.delivery_count
            _could_not_process(source, inbox, self._read_key, delivery.envelope, exc)
            await self._give_back(adapter, held, self.backoff.delay(count))
            raise AckMessage() from None
        if handled.outcome in (Outcome.PROCESSED, Outcome.STALE_RECLAIMED, Outcome.DUPLICATE):
            self._acknowledged(scope, adapter, held, (inbox.consumer, handled.key or ""))
            if handled.outcome is Outcome.DUPLICATE:
                return _first_result(handled, call_next, source, inbox.log_keys)
            return handled.value
        await self._settle(adapter, held, delivery.envelope, handled, inbox.consumer)
        raise AckMessage()  # settled here: FastStream publishes nothing and acks nothing

    def _unless_unfinished(
        self,
        run: Callable[[object], Awaitable[Any]],
        adapter: Adapter,
        held: Settling,
        envelope: Envelope,
    ) -> Callable[[object], Awaitable[Any]]:
        """``run``, unless :meth:`_unfinished` says the message is not run again."""

        async def checked(body: object) -> Any:
            unfinished = self._unfinished(adapter, held, envelope.delivery_count)
            if unfinished is not None:
                raise unfinished
            return await run(body)

        return checked

    def _unfinished(
        self, adapter: Adapter, held: Settling, count: int | None
    ) -> _NeverFinished | None:
        """Why the message is not run again (called under its claim, before the handler):
        ``max_deliveries`` runs of it began and none succeeded, the last of them never
        finished. The handler never returned, so no failure was counted: the worker running
        it died (a crash, ``os._exit``, the OOM killer) or hung past the lease, and a message
        that kills its worker every time would otherwise run for ever. The claim's attempt
        says how many runs in a row never finished (each such claim was taken over); the
        broker's count, where a give-back is not in it, adds the failures before them.
        ``None``: run it."""
        now = current()
        if now is None or now.attempt < 2:
            return None  # the key's last run ended (released by a failure), or none began
        unfinished = now.attempt - 1
        runs = unfinished
        if count is not None and _counted_give_back(adapter, held) is None:
            runs = max(runs, count - 1)
        if runs < self.max_deliveries:
            return None
        why = (
            f"the worker running it died, as on a crash, os._exit or the OOM killer, or hung "
            f"past the inbox's lease; max_deliveries is {self.max_deliveries}"
        )
        if runs == unfinished:
            return _NeverFinished(f"not run again: its {runs} earlier runs never finished ({why})")
        return _NeverFinished(
            f"not run again: its {runs} earlier runs failed or never finished (the last "
            f"{unfinished} never finished: {why})"
        )

    async def _unread(self, scope: _Scope, exc: Exception) -> bool:
        """A message of a protected subscriber that FastStream failed to parse (so no handler
        saw it) is dead-lettered with the error, where the broker can fail that way; ``True``
        when it was (the error is then handled)."""
        subscriber = scope.context.get("handler_")
        adapter = self._adapter(subscriber)
        source = None if adapter is None else adapter.source_of(subscriber)
        inbox = self._inbox_for(source)
        if adapter is None or inbox is None or _dead_letters(source):
            return False
        reason = f"FastStream could not read the message: {said(exc)}"
        why = DeadLetter(
            outcome="rejected", reason=reason, consumer=inbox.consumer, deliveries=None
        )
        try:
            done = await adapter.dead_letter_unread(
                scope.msg, subscriber, scope.context.get("broker"), why
            )
        except Exception as failure:
            LOGGER.error(
                "oncely faststream source=%s could not dead-letter a message FastStream could "
                "not read (%s: %s; the message: %s)",
                source,
                type(failure).__name__,
                failure,
                reason,
            )
            return False
        if done:
            LOGGER.error(
                "oncely faststream source=%s outcome=rejected action=dead_letter key=None "
                "reason=%s",
                source,
                printable(reason),
            )
        return done

    async def _settle(
        self,
        adapter: Adapter,
        held: Settling,
        envelope: Envelope,
        handled: Handled[Any],
        consumer: str,
    ) -> None:
        action = handled.action
        count = max(envelope.delivery_count or 0, handled.attempt) or None
        limit = adapter.delivery_limit(held.subscriber)
        last = limit is not None and (count or 0) >= limit  # give-backs and failures alike
        failures, given_back = count or 0, 0
        if action is Action.RETRY and count is not None and self._given_back:
            failures, given_back = self._given_back.failures(
                _counted_give_back(adapter, held), count
            )
        why: DeadLetter | None = None
        unfinished = isinstance(handled.error, _NeverFinished)
        if action is Action.REQUEUE_LATER and not last:
            how = "requeue"
            await self._give_back(adapter, held, self.requeue_delay)
        elif action is Action.RETRY and failures < self.max_deliveries and not (last or unfinished):
            how = "retry"
            try:
                await adapter.retry(held, self.backoff.delay(failures or None), count or 1)
            except Exception as exc:
                how = "retry failed (left to the broker)"
                self._settlement_failed(adapter, held, "retry", exc)
            finally:
                adapter.settled(held)
        else:
            how = "dead_letter"
            reason = handled.reason or handled.outcome.value
            outcome = handled.outcome.value
            if unfinished:
                outcome, reason = Outcome.REJECTED.value, str(handled.error)
            elif action is Action.RETRY and failures >= self.max_deliveries:
                outcome = Outcome.REJECTED.value
                reason = failed_reason(failures, count or 0, given_back, reason)
            elif action in (Action.RETRY, Action.REQUEUE_LATER):
                outcome = Outcome.REJECTED.value
                reason = (
                    f"delivered {count} times, the {adapter.broker_name} subscriber's own "
                    f"delivery limit: the broker would not deliver it again (raise it above "
                    f"max_deliveries); last: {reason}"
                )
            why = DeadLetter(outcome=outcome, reason=reason, consumer=consumer, deliveries=count)
            try:
                await adapter.dead_letter(held, why)
                self._finished(adapter, held)
            except Exception as exc:  # never acked without its copy: given back, later
                how = "requeue (the dead-letter copy failed)"
                LOGGER.error(
                    "oncely faststream source=%s could not dead-letter a message (%s: %s); it "
                    "is given back and will be redelivered",
                    held.source,
                    type(exc).__name__,
                    exc,
                )
                await self._give_back(adapter, held, _DEAD_LETTER_RETRY)
            finally:
                adapter.settled(held)
        level = logging.ERROR if how.startswith(("dead_letter", "requeue (")) else handled.log_level
        inbox = self._inbox_for(held.source)
        _log_settled(level, held.source, inbox, handled, how, count, why, consumer)

    async def _give_back(self, adapter: Adapter, held: Settling, delay: timedelta) -> None:
        """Give the message back unrun (never a failure: a copy that met a running one, the
        store away, a result or dead letter that could not be sent), noted where the broker
        counts it as a delivery, so that its later failures are counted without it."""
        self._given_back.note(_counted_give_back(adapter, held))
        try:
            await adapter.give_back(held, delay)
        except Exception as exc:
            self._settlement_failed(adapter, held, "give back", exc)
        finally:
            adapter.settled(held)

    def _acknowledged(
        self, scope: _Scope, adapter: Adapter, held: Settling, result_key: tuple[str, str]
    ) -> None:
        """The message is done, FastStream acknowledges it: results published from here on
        carry an id derived from ``result_key`` (the consumer and the key), and its
        give-backs are forgotten."""
        scope.result_key = result_key
        self._finished(adapter, held)

    def _finished(self, adapter: Adapter, held: Settling) -> None:
        """The message is acknowledged or dead-lettered: its give-backs are forgotten."""
        if self._given_back:
            self._given_back.forget(_counted_give_back(adapter, held))

    @staticmethod
    def _settlement_failed(adapter: Adapter, held: Settling, what: str, exc: Exception) -> None:
        LOGGER.error(
            "oncely faststream source=%s could not %s a message (%s: %s); it is left "
            "unacknowledged for %s to deliver again",
            held.source,
            what,
            type(exc).__name__,
            exc,
            adapter.broker_name,
        )

    def _later(self, later: Coroutine[Any, Any, None]) -> None:
        """Run a delayed settlement in the background (kept referenced until it ends)."""
        task = asyncio.get_running_loop().create_task(later)
        self._held.add(task)
        task.add_done_callback(self._held.discard)


class _Scope(BaseMiddleware):
    """The middleware's state for one message."""

    def __init__(self, owner: Idempotency, msg: Any, /, *, context: Any) -> None:
        super().__init__(msg, context=context)
        self.owner = owner
        self.result_key: tuple[str, str] | None = None
        self.adapter: Adapter | None = None
        self.held: Settling | None = None
        self.deliveries: int | None = None
        self.reached = False

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
        self.reached = True
        return await self.owner._consume(self, call_next, msg)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        # A message FastStream could not parse never reaches consume_scope.
        if self.reached or not isinstance(exc_val, Exception):
            return False
        return await self.owner._unread(self, exc_val)

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        if self.result_key is None or self.adapter is None or self.held is None:
            return await call_next(cmd)
        consumer, key = self.result_key
        where = f"{getattr(cmd, 'exchange', '')}\n{getattr(cmd, 'destination', '')}"
        derived = str(uuid.uuid5(_RESULT_IDS, f"{consumer}\n{key}\n{where}"))
        self.adapter.stamp(cmd, derived)
        try:
            return await call_next(cmd)
        except Exception as exc:
            # The claim is complete and its result stored: given back, the message comes
            # again as a duplicate, which publishes the result again. Left to FastStream, the
            # error rejected it (the default ack policy), and the result was never published.
            shown = self.owner._shown_key(self.held.source, key)
            inbox = self.owner._inbox_for(self.held.source)
            log_keys = inbox.log_keys if inbox is not None else "plain"
            LOGGER.error(
                "oncely faststream source=%s key=%s could not publish its result (%s: %s); the "
                "message is given back, and its redelivery publishes the stored result",
                self.held.source,
                printable(shown),
                type(exc).__name__,
                redact_keys(str(exc), (key,), log_keys),
            )
            delay = self.owner.backoff.delay(self.deliveries)
            await self.owner._give_back(self.adapter, self.held, delay)
            raise AckMessage() from None


async def _exit(code: int, worker_id: Any) -> NoReturn:
    """End the process with ``code`` from inside FastStream's event loop, without a
    traceback. ``SystemExit`` raised in the start-up hook would fail FastStream's task group,
    which asyncio then reports (a traceback) as it shuts the loop down; raised by a callback
    of the loop itself it stops the loop at once, the tasks (this hook's included) are
    cancelled, and ``faststream run`` exits with ``code``.

    A worker of ``faststream run --workers N`` (``worker_id`` a number) first asks FastStream's
    supervisor, its parent, to stop (``SIGTERM``, as a person's Ctrl+C): the supervisor starts
    a worker again whatever its exit status, so without this every worker would stop, be
    started again and stop again, without end."""
    parent = multiprocessing.parent_process()
    if isinstance(worker_id, int) and parent is not None and parent.pid is not None:
        STARTUP_LOGGER.error(
            "oncely faststream: worker %d stops, and with it FastStream's supervisor "
            "(pid %d) and its other workers",
            worker_id,
            parent.pid,
        )
        with contextlib.suppress(OSError):
            os.kill(parent.pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    loop.call_soon(_raise_exit, code)
    await loop.create_future()  # never done: the loop stops first
    raise SystemExit(code)  # pragma: no cover - not reached


def _raise_exit(code: int) -> NoReturn:
    raise SystemExit(code)


def _first_result(
    handled: Handled[Any], call_next: Any, source: str, log_keys: Literal["plain", "hash"]
) -> Any:
    """What a duplicate publishes: the first result, rebuilt as the handler's return
    annotation (``bytes``, a ``datetime``, a model...), as FastStream published it the first
    time; the stored (JSON) form where there is none. A first result that was not kept is
    published as nothing (``AckMessage``: acknowledged), never as an empty message. Its
    line shows the key as the inbox shows keys (``log_keys``)."""
    key = printable(key_for_logs(handled.key, log_keys) or "")
    try:
        value = first_result(handled, _handler_of(call_next), source)
    except ResultUnavailable:
        LOGGER.warning(
            "oncely faststream source=%s key=%s: a duplicate, not run; its first result is not "
            "there to publish again (%s): nothing is published",
            source,
            key,
            handled.reason,
        )
        raise AckMessage() from None
    LOGGER.info("oncely faststream source=%s key=%s: a duplicate, not run", source, key)
    return value


class _NeverFinished(Released):
    """Raised under a message's claim instead of running it again: its earlier runs never
    finished (see :meth:`Idempotency._unfinished`). Released as a failure is, so a copy
    resubmitted from the dead letters runs again; dead-lettered with this reason. A
    :class:`~oncely._core.outcomes.Released`: the inbox logs the reason (``released: not run
    again: ...``), not a handler that raised, since none ran."""


def _counted_give_back(adapter: Adapter, held: Settling) -> Hashable | None:
    """:meth:`Adapter.counted_give_back`; ``None`` where the message cannot say (a message
    the adapter could not read: its give-back counts as a failure, as every delivery did)."""
    try:
        return adapter.counted_give_back(held)
    except Exception:
        return None


def _unannotated(*args: Any) -> Any:  # a duplicate's result stays in its stored form
    return None


def _handler_of(call_next: Any) -> Callable[..., Any]:
    """The user's handler under ``call_next`` (the inner middlewares' ``consume_scope``
    partials around FastStream's ``call_wrapped`` of the handler that matched), for its
    return annotation; :func:`_unannotated` where it cannot be found."""
    call = call_next
    while isinstance(call, functools.partial) and call.args:
        call = call.args[0]
    handler = getattr(getattr(call, "__self__", None), "_original_call", None)
    return handler if callable(handler) else _unannotated


def _protectable(adapter: Adapter | None, subscriber: Any, raw: Any, source: str) -> Adapter:
    """``adapter``, once sure it can protect ``subscriber``'s message ``raw``; else
    :class:`~oncely.ConfigurationError` (never run a handler unprotected behind a middleware
    that says it protects it)."""
    if adapter is None:
        raise _not_adapted(subscriber, raw)
    why = _unprotectable(adapter, subscriber, source)
    if why is None and not adapter.is_delivery(raw):
        raise _not_adapted(subscriber, raw)
    why = why or _acks_alone(subscriber, source)
    if why is not None:
        raise ConfigurationError(f"{why}: the message was not processed")
    return adapter


def _refusal(adapter: Adapter | None, subscriber: Any, source: str) -> str | None:
    """Why the middleware cannot protect ``subscriber`` (``None``: it can), before any
    message: what :func:`_protectable` refuses a message of ``subscriber`` for."""
    if adapter is None:
        return (
            f"oncely.integrations.faststream adapts FastStream's {ADAPTED}, not the "
            f"{type(subscriber).__module__} subscriber of {source!r}"
        )
    return _unprotectable(adapter, subscriber, source) or _acks_alone(subscriber, source)


def _unprotectable(adapter: Adapter, subscriber: Any, source: str) -> str | None:
    refused = adapter.unprotectable(subscriber)
    if refused is None:
        return None
    return f"oncely cannot protect the {adapter.broker_name} subscriber of {source!r}: {refused}"


def _acks_alone(subscriber: Any, source: str) -> str | None:
    policy = getattr(subscriber, "ack_policy", None)
    if policy in (AckPolicy.ACK_FIRST, AckPolicy.MANUAL):
        return (
            f"oncely cannot protect the subscriber of {source!r}: its ack_policy is "
            f"{policy.name}, so FastStream acknowledges (or commits) the message whatever its "
            "outcome, or never does; give it ack_policy=AckPolicy.ACK (the default of "
            "RabbitMQ, NATS and Redis subscribers is fine; Kafka's commits automatically)"
        )
    return None


@contextlib.asynccontextmanager
async def _kept(adapter: Adapter, held: Settling, every: timedelta) -> AsyncIterator[None]:
    """While the handler runs, tell the broker every ``every`` that the message is still
    being worked on (so it is not delivered to another consumer meanwhile)."""
    every = max(every, timedelta(milliseconds=10))

    async def keep() -> None:
        while True:
            await asyncio.sleep(every.total_seconds())
            try:
                await adapter.extend(held)
            except Exception as exc:  # the settlement after the handler still decides
                LOGGER.warning(
                    "oncely faststream source=%s could not extend a running message (%s: %s)",
                    held.source,
                    type(exc).__name__,
                    exc,
                )

    task = asyncio.get_running_loop().create_task(keep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _not_adapted(subscriber: Any, raw: Any) -> ConfigurationError:
    return ConfigurationError(
        f"oncely.integrations.faststream adapts FastStream's {ADAPTED}; this message came "
        f"from {type(subscriber).__module__} ({type(raw).__name__}), which it cannot claim: "
        "the message was not processed"
    )


def _dead_letters(queue: str | None) -> bool:
    """A subscriber that reads a dead-letter queue is left alone (its copies keep the id of
    the message they copy)."""
    return queue is not None and queue.endswith(DEAD_LETTER_SUFFIX)


def _binding(exc: Exception) -> bool:
    """Whether ``exc`` is FastStream failing to bind the decoded body to the handler's
    arguments (raised in fast_depends' validation, before the handler's own code runs), not
    a validation error of the handler's own."""
    if isinstance(exc, BindingError):
        return True
    if type(exc).__name__ != "ValidationError":
        return False
    last_ours = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/fast_depends/" in filename:
            last_ours = "fast_depends"
        elif "/pydantic" not in filename:
            last_ours = filename
        tb = tb.tb_next
    return last_ours == "fast_depends"


def _reads_body(source: KeySource) -> bool:
    if isinstance(source, BusinessKey):
        return True
    return isinstance(source, FirstOf) and any(_reads_body(each) for each in source.sources)


def _could_not_process(
    source: str,
    inbox: AsyncInbox,
    read_key: Callable[[Envelope], str],
    envelope: Envelope,
    exc: Exception,
) -> None:
    """Log a message given back because the store failed, with its key (as the inbox shows
    keys) and correlation id (R16)."""
    try:
        raw: str | None = read_key(envelope)
    except Exception:
        raw = None
    key = key_for_logs(raw, inbox.log_keys)
    correlation_id = envelope.correlation_id
    said = redact_keys(f"{type(exc).__name__}: {exc}", (raw,), inbox.log_keys)
    LOGGER.error(
        "oncely faststream source=%s could not process a message (%s); it is given back "
        "and will be redelivered key=%s correlation_id=%s",
        source,
        said,
        None if key is None else printable(key),
        None if correlation_id is None else printable(correlation_id),
        extra={
            "oncely_source": source,
            "oncely_broker_action": "retry",
            "oncely_key": key,
            "oncely_correlation_id": correlation_id,
            "oncely_consumer": inbox.consumer,
            "oncely_deliveries": envelope.delivery_count,
            "oncely_reason": said,
        },
    )


def _log_settled(
    level: int,
    source: str,
    inbox: AsyncInbox | None,
    handled: Handled[Any],
    how: str,
    count: int | None,
    why: DeadLetter | None,
    consumer: str,
) -> None:
    """The one line per message: its outcome and broker action, its key as the inbox shows
    keys, and its correlation id (R16)."""
    log_keys = inbox.log_keys if inbox is not None else "plain"
    key = key_for_logs(handled.key, log_keys)
    correlation_id = handled.correlation_id
    # A reason (a dead letter's too) may name the key: a handler's error, a store's.
    shown = why.reason if why else handled.reason
    shown = shown and redact_keys(shown, (handled.key,), log_keys)
    LOGGER.log(
        level,
        "oncely faststream source=%s outcome=%s action=%s key=%s correlation_id=%s deliveries=%s%s",
        source,
        handled.outcome.value,
        how,
        None if key is None else printable(key),
        None if correlation_id is None else printable(correlation_id),
        count,
        f" reason={printable(shown)}" if shown else "",
        extra={
            "oncely_source": source,
            "oncely_outcome": handled.outcome.value,
            "oncely_broker_action": how,
            "oncely_key": key,
            "oncely_correlation_id": correlation_id,
            "oncely_consumer": consumer,
            "oncely_deliveries": count,
            "oncely_reason": shown,
        },
    )
