"""Distributed tracing with OpenTelemetry (R16: follow a message across services), opt-in.

Tracing is off unless it is asked for, and then costs nothing: with it off, nothing of
OpenTelemetry is imported or called (this module imports it only when tracing is turned on).
It needs the ``opentelemetry-api`` package (``pip install 'oncely[otel]'``) and, to export
spans anywhere, an SDK configured by the application, as with any instrumented library.

A consumer (``BrokerConsumer(..., tracing=True)``, ``oncely consume --tracing``) makes one
span per delivery, of kind CONSUMER, named ``process <destination>`` as OpenTelemetry's
messaging conventions name it. Its parent is the context the producer put in the message's
headers (read with the global propagator: W3C ``traceparent`` and ``tracestate`` by
default), so the producer's trace goes on; the handler runs with the span current, so the
spans it makes are its children (in a batch as well, each handler under its own message's
span; a :class:`~oncely.brokers.Processor` of your own runs under the span one message at a
time, under none in a batch). The span carries:

=====================================  ==================================================
``messaging.system``                   the broker: ``rabbitmq``, ``redis-streams``,
                                       ``nats``, ``kafka``, ``aws_sqs``
``messaging.destination.name``         the queue, stream, subject or topic read
``messaging.operation.type``           ``process``
``messaging.message.id``               the producer's message id
``messaging.message.conversation_id``  the correlation id
``oncely.consumer``                    the inbox's consumer name
``oncely.key``                         the dedup key, as the inbox's log lines show it
``oncely.outcome``                     ``processed``, ``duplicate``, ``failed``, ...
``oncely.attempt``                     the inbox's attempt number
``oncely.broker_action``               ``ack``, ``retry``, ``dead_letter`` or ``requeue``
``oncely.deliveries``                  the broker's delivery count, where it keeps one
``oncely.reason``                      the outcome's reason, where it has one
=====================================  ==================================================

Under ``log_keys="hash"`` the key, and the message id (often the key itself), are shown
hashed, as in the log lines, also where an error's text names the key (the reason, the
status, the exception event's message and stack trace): a key that is personal data reaches
no trace backend. A
``failed``, ``rejected``, ``key_conflict`` or ``escalated`` outcome sets the span's status
to ERROR with its reason, and the handler's exception is recorded on it.

A producer (``open_producer(url, destination, tracing=True)``, or any producer wrapped in
:class:`TracedProducer`) makes a PRODUCER span ``send <destination>`` around each publish,
a child of the span current where ``publish`` is called, and puts its context in the
message's headers: the consumer's span is that span's child, in the same trace. A message
published by other code carries the context with :func:`inject`.

``tracing`` is ``True`` (the global tracer provider) or a ``TracerProvider`` of your own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Union

from oncely.errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from oncely._otel import ConsumerSpans, ProducerSpans
    from oncely.brokers import Producer

__all__ = ["TracedProducer", "Tracing", "inject"]

Tracing = Union[bool, "TracerProvider"]
"""What turns tracing on: ``True`` (the global tracer provider), a ``TracerProvider``; or
``False``, off (the default)."""

INSTRUMENTATION = "oncely"
"""The instrumentation scope name of oncely's spans."""


def _require() -> None:
    """Import OpenTelemetry's API (tracing is on), or say which extra installs it."""
    try:
        import opentelemetry.trace  # noqa: F401, PLC0415 - only with tracing on
    except ImportError:
        raise ConfigurationError(
            "tracing needs OpenTelemetry's API: pip install 'oncely[otel]' (and an SDK, "
            "opentelemetry-sdk, configured to export the spans)"
        ) from None


def _provider(tracing: Tracing) -> Any:
    """The tracer provider ``tracing`` names (None: the global one)."""
    if tracing is True:
        return None
    if isinstance(tracing, bool) or not hasattr(tracing, "get_tracer"):
        raise ConfigurationError(
            f"tracing is True or an OpenTelemetry TracerProvider, not {tracing!r}"
        )
    return tracing


def consumer_spans(
    tracing: Tracing,
    *,
    system: str,
    destination: str,
    consumer: str,
    log_keys: str,
) -> ConsumerSpans | None:
    """The spans of a consumer's deliveries, or None with tracing off (nothing imported)."""
    if tracing is False:
        return None
    provider = _provider(tracing)
    _require()
    from oncely._otel import ConsumerSpans  # noqa: PLC0415 - imports OpenTelemetry

    return ConsumerSpans(
        provider, system=system, destination=destination, consumer=consumer, log_keys=log_keys
    )


def inject(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """``headers`` (a copy) with the current trace context added by the global propagator
    (W3C ``traceparent``, ``tracestate``): publish a message with them, from code other than
    oncely's producers, and the consumer's span continues the trace. Needs
    ``oncely[otel]``."""
    _require()
    from opentelemetry import propagate  # noqa: PLC0415 - only when asked for

    carrier = dict(headers) if headers else {}
    propagate.inject(carrier)
    return carrier


class TracedProducer:
    """A :class:`~oncely.brokers.Producer` whose every publish is a PRODUCER span
    ``send <destination>`` (a child of the span current at the call), its context put in the
    message's headers (W3C ``traceparent``) for the consumer's span to continue. A publish
    that raises ends its span with status ERROR and the exception recorded.
    ``open_producer(url, destination, tracing=True)`` returns one; wrap a producer made
    directly as ``TracedProducer(RabbitMQProducer(url, "payments"), system="rabbitmq",
    destination="payments")``. ``log_keys="hash"`` shows each message id hashed in its span
    (ids that are personal data), as a consumer's spans show them under an inbox's
    ``log_keys="hash"``. Needs ``oncely[otel]``."""

    def __init__(
        self,
        producer: Producer,
        *,
        system: str,
        destination: str,
        tracing: Tracing = True,
        log_keys: Literal["plain", "hash"] = "plain",
    ) -> None:
        if tracing is False:
            raise ConfigurationError("a TracedProducer traces: give it tracing=True or a provider")
        provider = _provider(tracing)
        _require()
        from oncely._otel import ProducerSpans  # noqa: PLC0415 - imports OpenTelemetry

        self.producer = producer
        """The producer wrapped."""
        self._spans: ProducerSpans = ProducerSpans(
            provider, system=system, destination=destination, log_keys=log_keys
        )

    def __repr__(self) -> str:
        return f"TracedProducer({self.producer!r})"

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> None:
        """The wrapped producer's ``publish``, in a span whose context the headers carry."""
        with self._spans.send(message_id, correlation_id, headers) as carried:
            await self.producer.publish(
                body,
                message_id=message_id,
                headers=carried,
                content_type=content_type,
                correlation_id=correlation_id,
            )

    async def close(self) -> None:
        await self.producer.close()
