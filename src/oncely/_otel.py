"""OpenTelemetry spans of consumers and producers: imported by :mod:`oncely.tracing` only once
tracing is turned on (this module imports OpenTelemetry)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from inspect import isasyncgenfunction, isawaitable, isgeneratorfunction
from typing import Any, Literal, cast

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from oncely import __version__
from oncely._core.context import _CURRENT
from oncely._core.keys import hashed_key
from oncely._core.observe import key_for_logs, redact_keys
from oncely._core.outcomes import Handled, Outcome
from oncely.wire import escaped

_ERRORS = frozenset({Outcome.FAILED, Outcome.REJECTED, Outcome.KEY_CONFLICT, Outcome.ESCALATED})
"""Outcomes whose span's status is ERROR: a failure, or what a person must look at."""

_SYSTEMS = {"sqs": "aws_sqs"}
"""Where OpenTelemetry's ``messaging.system`` names a broker otherwise than oncely's logs."""

_SPANS: ContextVar[Mapping[str, Span] | None] = ContextVar("oncely_batch_spans", default=None)
"""The spans of a batch's messages by key: the handler the inbox runs for one of them runs
under its span (the inbox calls a batch's handlers with the payload alone)."""


class _Headers(Getter[Mapping[str, object]]):
    """Reads a message's headers for the propagator: text or UTF-8 bytes (Kafka's), their
    names in any case (a header that is no text is not a context)."""

    def get(self, carrier: Mapping[str, object], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            lowered = key.lower()
            for name, found in carrier.items():
                if name.lower() == lowered:
                    value = found
                    break
        if isinstance(value, bytes | bytearray):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                return None
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, object]) -> list[str]:
        return [str(name) for name in carrier]


_GETTER = _Headers()


def _tracer(provider: Any) -> trace.Tracer:
    if provider is None:
        return trace.get_tracer("oncely", __version__)
    return cast(trace.Tracer, provider.get_tracer("oncely", __version__))


class _Spans:
    """What a consumer's and a producer's spans share: the tracer, the span's name
    (``<operation> <destination>``), how keys show, and the attributes every span has."""

    def __init__(
        self, provider: Any, operation: str, *, system: str, destination: str, log_keys: str
    ) -> None:
        self._tracer = _tracer(provider)
        self._name = f"{operation} {destination}"
        self._log_keys: Literal["plain", "hash"] = "hash" if log_keys == "hash" else "plain"
        self._base: dict[str, str] = {
            "messaging.system": _SYSTEMS.get(system, system),
            "messaging.destination.name": destination,
            "messaging.operation.type": operation,
            "messaging.operation.name": operation,
        }


class ConsumerSpans(_Spans):
    """A consumer's span per delivery, from its start to its broker action (ack, retry,
    dead letter, requeue)."""

    def __init__(
        self, provider: Any, *, system: str, destination: str, consumer: str, log_keys: str
    ) -> None:
        super().__init__(
            provider, "process", system=system, destination=destination, log_keys=log_keys
        )
        self._base["oncely.consumer"] = consumer
        self._open: dict[int, Span] = {}
        """The spans started and not ended yet, by the id of their delivery."""

    def start(self, delivery: Any) -> Span:
        """The delivery's span, started (once) with the producer's context as its parent."""
        span = self._open.get(id(delivery))
        if span is not None:
            return span
        envelope = delivery.envelope
        parent: Context = propagate.extract(envelope.headers, getter=_GETTER)
        attributes: dict[str, str | int] = dict(self._base)
        message_id = envelope.message_id
        if message_id and not escaped(message_id):
            attributes["messaging.message.id"] = cast(str, key_for_logs(message_id, self._log_keys))
        if envelope.correlation_id:
            attributes["messaging.message.conversation_id"] = envelope.correlation_id
        if delivery.delivery_count is not None:
            attributes["oncely.deliveries"] = delivery.delivery_count
        span = self._tracer.start_span(
            self._name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        )
        self._open[id(delivery)] = span
        return span

    @contextlib.contextmanager
    def current(self, delivery: Any) -> Iterator[None]:
        """The delivery's span current for the block (the handler's spans its children)."""
        with trace.use_span(
            self.start(delivery),
            end_on_exit=False,
            record_exception=False,
            set_status_on_exception=False,
        ):
            yield

    @contextlib.contextmanager
    def batch(self, keyed: Sequence[tuple[str | None, Any]]) -> Iterator[None]:
        """For the block, each handler the inbox runs for one of ``keyed``'s ``(key,
        delivery)`` runs under that delivery's span (the first one of a key: a later copy in
        the batch runs no handler)."""
        spans: dict[str, Span] = {}
        for key, delivery in keyed:
            if key is not None and key not in spans:
                spans[key] = span = self.start(delivery)
                # The inbox claims a key over Limits.max_key_bytes hashed (hash_long_keys).
                spans.setdefault(hashed_key(key), span)
        token = _SPANS.set(spans)
        try:
            yield
        finally:
            _SPANS.reset(token)

    def handler(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler``, run under the span of its message when a batch's spans are set
        (:meth:`batch`); as it is otherwise. A sync handler stays sync, an async one's
        coroutine is awaited under the span. A generator function is left as it is, for
        the inbox to refuse."""
        if isgeneratorfunction(handler) or isasyncgenfunction(handler):
            return handler

        def traced(*args: Any) -> Any:
            spans = _SPANS.get()
            fields = _CURRENT.get()
            span = spans.get(fields[1]) if spans is not None and fields is not None else None
            if span is None:
                return handler(*args)
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                returned = handler(*args)
            if isawaitable(returned):
                return _under(span, returned)
            return returned

        traced.__name__ = getattr(handler, "__name__", "handler")
        traced.__qualname__ = getattr(handler, "__qualname__", traced.__name__)
        return traced

    def settled(
        self,
        delivery: Any,
        handled: Handled[Any],
        action: str,
        *,
        reason: str | None = None,
        carried_out: bool = True,
    ) -> None:
        """End the delivery's span with its outcome and the broker action taken (or, not
        ``carried_out``, tried: the broker redelivers the message)."""
        span = self._open.pop(id(delivery), None)
        if span is None:  # settled without having run (held back behind its group)
            self.start(delivery)
            span = self._open.pop(id(delivery))
        key = key_for_logs(handled.key, self._log_keys)
        if key is not None:
            span.set_attribute("oncely.key", key)
        span.set_attribute("oncely.outcome", handled.outcome.value)
        span.set_attribute("oncely.attempt", handled.attempt)
        span.set_attribute("oncely.broker_action", action)
        if handled.correlation_id and not delivery.envelope.correlation_id:
            span.set_attribute("messaging.message.conversation_id", handled.correlation_id)
        why = reason or handled.reason
        why = why and redact_keys(why, (handled.key,), self._log_keys)
        if why:
            span.set_attribute("oncely.reason", why)
        error = handled.error
        if error is not None:
            self._record(span, error, (handled.key,))
        if not carried_out:
            failed = f"could not {action} the message; the broker redelivers it"
            span.set_attribute("oncely.broker_action_failed", True)
            span.set_status(Status(StatusCode.ERROR, failed))
        elif handled.outcome in _ERRORS or action == "dead_letter":
            span.set_status(Status(StatusCode.ERROR, why or handled.outcome.value))
        span.end()

    def gave_back(
        self,
        delivery: Any,
        reason: str,
        error: BaseException | None = None,
        keys: Iterable[str | None] = (),
    ) -> None:
        """End the span of a delivery given back with no outcome (the store failed, a
        shutdown): action ``retry``, status ERROR with ``reason`` (its keys shown already as
        the lines show them); ``error``'s text shows ``keys`` so too."""
        span = self._open.pop(id(delivery), None)
        if span is None:
            return
        span.set_attribute("oncely.broker_action", "retry")
        span.set_attribute("oncely.reason", reason)
        if error is not None:
            self._record(span, error, keys)
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    def _record(self, span: Span, error: BaseException, keys: Iterable[str | None]) -> None:
        """``span.record_exception(error)``, its message and stack trace showing ``keys`` as
        the log lines show keys (under ``log_keys="hash"`` an error naming the key would
        carry it into the span's exception event as it is)."""
        if self._log_keys == "plain":
            span.record_exception(error)
            return
        keys = tuple(keys)
        stacktrace = "".join(traceback.format_exception(error))
        span.record_exception(
            error,
            attributes={
                "exception.message": redact_keys(str(error), keys, self._log_keys),
                "exception.stacktrace": redact_keys(stacktrace, keys, self._log_keys),
            },
        )

    def ended(self, deliveries: Sequence[Any], reason: str) -> None:
        """End the spans of ``deliveries`` still open (given back unsettled)."""
        for delivery in deliveries:
            if id(delivery) in self._open:
                self.gave_back(delivery, reason)


async def _under(span: Span, work: Awaitable[Any]) -> Any:
    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        return await work


class ProducerSpans(_Spans):
    """A producer's span per publish, its context carried in the message's headers."""

    def __init__(
        self, provider: Any, *, system: str, destination: str, log_keys: str = "plain"
    ) -> None:
        super().__init__(
            provider, "send", system=system, destination=destination, log_keys=log_keys
        )

    @contextlib.contextmanager
    def send(
        self, message_id: str, correlation_id: str | None, headers: Mapping[str, str] | None
    ) -> Iterator[dict[str, str]]:
        """A PRODUCER span for the block; yields ``headers`` with its context added."""
        attributes = dict(self._base)
        attributes["messaging.message.id"] = cast(str, key_for_logs(message_id, self._log_keys))
        if correlation_id:
            attributes["messaging.message.conversation_id"] = correlation_id
        with self._tracer.start_as_current_span(
            self._name, kind=SpanKind.PRODUCER, attributes=attributes
        ):
            carried = dict(headers) if headers else {}
            propagate.inject(carried)
            yield carried
