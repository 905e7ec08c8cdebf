"""R13: a consumer derives its redelivery horizon from its own settings and what the broker
says, and refuses to start with an inbox that would forget records sooner. The real brokers'
numbers are checked by the shared suite (test_rabbitmq/test_redis_streams/test_nats)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely.brokers import Backoff, BrokerConsumer, BrokerLimits, ConsumerSettings
from oncely.errors import ConfigurationError, RetentionTooShort
from oncely.testing import MemoryBroker

SECOND = timedelta(seconds=1)
HOUR = timedelta(hours=1)


def test_r13_the_horizon_of_the_default_settings() -> None:
    # 5 deliveries, each held for the ack wait and then backed off up to 8 s (the delay
    # before the 5th delivery), plus a day in which an operator may resubmit.
    horizon = ConsumerSettings().horizon(BrokerLimits(ack_wait=30 * SECOND))
    assert horizon.max_deliveries == 5
    assert horizon.lock == 30 * SECOND
    assert horizon.redelivery_delay == 8 * SECOND
    assert horizon.message_ttl == timedelta(0)
    assert horizon.resubmit_window == timedelta(days=1)
    assert horizon.total == timedelta(days=1, minutes=3, seconds=10)
    assert horizon.explain() == (
        "max_deliveries=5 x (lock=30s + delay=8s) + message_ttl=0s + resubmit_window=1d"
    )


def test_r13_a_thousand_deliveries_with_an_hour_of_backoff_need_six_weeks() -> None:
    settings = ConsumerSettings(max_deliveries=1000, backoff=Backoff(most=HOUR))
    horizon = settings.horizon(BrokerLimits(ack_wait=30 * SECOND))
    assert horizon.redelivery_delay == HOUR
    assert horizon.total == 1000 * (30 * SECOND + HOUR) + timedelta(days=1)
    with pytest.raises(RetentionTooShort, match=r"^retention 2m is below the redelivery"):
        oncely.Retention(keep=timedelta(minutes=2)).check(horizon)


def test_r13_the_broker_limits_count_where_they_bind() -> None:
    settings = ConsumerSettings(max_deliveries=10, resubmit_window=timedelta(0))
    # The broker stops after 3 deliveries: only 3 can happen.
    assert settings.horizon(BrokerLimits(max_deliveries=3)).max_deliveries == 3
    assert settings.horizon(BrokerLimits(max_deliveries=50)).max_deliveries == 10
    # A time-to-live from the broker and one stated in the settings: the longer counts.
    assert settings.horizon(BrokerLimits(message_ttl=HOUR)).message_ttl == HOUR
    stated = ConsumerSettings(message_ttl=2 * HOUR)
    assert stated.horizon(BrokerLimits(message_ttl=HOUR)).message_ttl == 2 * HOUR
    assert stated.horizon(BrokerLimits(message_ttl=3 * HOUR)).message_ttl == 3 * HOUR
    assert stated.horizon(None).message_ttl == 2 * HOUR
    # The requeue delay of an in_flight copy counts when it is longer than the backoff.
    slow = ConsumerSettings(requeue_delay=HOUR, max_deliveries=2)
    assert slow.horizon().redelivery_delay == HOUR


def test_a_backoff_survives_any_delivery_count() -> None:
    # Regression: 2 ** 63 seconds overflowed timedelta; the delay is capped at ``most``.
    backoff = Backoff(first=SECOND, most=HOUR)
    assert backoff.delay(999) == backoff.delay(10**9) == HOUR
    assert backoff.delay(3) == 4 * SECOND


def test_settings_refuse_a_negative_window_or_ttl() -> None:
    with pytest.raises(ConfigurationError, match="resubmit_window"):
        ConsumerSettings(resubmit_window=-SECOND)
    with pytest.raises(ConfigurationError, match="message_ttl"):
        ConsumerSettings(message_ttl=-SECOND)


async def test_r13_the_consumer_refuses_to_start_and_reads_nothing() -> None:
    broker = MemoryBroker(extend_every=10 * SECOND)  # no limits property: ack wait 3 x 10 s
    broker.publish(b'{"order": 1}', message_id="order-1")
    inbox = oncely.AsyncInbox(
        oncely.AsyncMemoryStore(),
        consumer="orders",
        retention=oncely.Retention(keep=timedelta(hours=2)),
    )
    applied: list[object] = []

    async def handler(payload: object) -> None:
        applied.append(payload)

    settings = ConsumerSettings(max_deliveries=100, backoff=Backoff(most=timedelta(minutes=5)))
    consumer = BrokerConsumer(broker, inbox, handler, settings=settings)
    with pytest.raises(RetentionTooShort) as refused:
        await consumer.run()
    assert str(refused.value) == (
        "retention 2h is below the redelivery horizon of this consumer on memory 1d9h10m "
        "(max_deliveries=100 x (lock=30s + delay=5m) + message_ttl=0s + resubmit_window=1d); "
        "raise the inbox's Retention(keep=...), or lower max_deliveries, the backoff, the ack "
        "wait or ConsumerSettings.resubmit_window"
    )
    assert applied == [] and broker.acked == 0 and broker.outstanding == 1
    # keep_failed is checked too: a poison message's record must outlive the horizon.
    inbox = oncely.AsyncInbox(
        oncely.AsyncMemoryStore(),
        consumer="orders",
        retention=oncely.Retention(keep=timedelta(days=7), keep_failed=timedelta(hours=1)),
    )
    with pytest.raises(RetentionTooShort, match=r"^keep_failed 1h is below"):
        await BrokerConsumer(broker, inbox, handler).run()


async def test_r13_a_covering_retention_logs_the_horizon_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = MemoryBroker()
    broker.publish(b'{"order": 1}', message_id="order-1")
    inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="orders")

    async def handler(payload: object) -> None:
        return None

    consumer = BrokerConsumer(broker, inbox, handler)
    with caplog.at_level(logging.INFO, logger="oncely.broker"):
        await broker.run_until_idle(consumer)
    lines = [r for r in caplog.records if "redelivery horizon" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].getMessage() == (
        "oncely broker=memory consumer=orders redelivery horizon 1d40s = max_deliveries=5 x "
        "(lock=0s + delay=8s) + message_ttl=0s + resubmit_window=1d; retention 7d covers it"
    )
    assert lines[0].oncely_horizon_ms == consumer.horizon.total // timedelta(milliseconds=1)
    assert broker.acked == 1


class _SyncInboxProcessor:
    """A processor of one's own over a sync :class:`oncely.Inbox` (as the Django worker's)."""

    def __init__(self, inbox: oncely.Inbox) -> None:
        self.inbox = inbox
        self.consumer = inbox.consumer

    async def process(self, envelope: oncely.Envelope) -> oncely.Handled[Any]:
        return self.inbox.handle_message(envelope, lambda payload: None)

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> oncely.Handled[Any]:
        return self.inbox.refuse(reason, key=key, correlation_id=correlation_id)


async def test_r13_a_processors_sync_inbox_is_held_to_the_horizon_and_refuses_purge_every() -> None:
    broker = MemoryBroker(extend_every=10 * SECOND)
    broker.publish(b'{"order": 1}', message_id="order-1")
    short = oncely.Inbox(
        oncely.MemoryStore(), consumer="orders", retention=oncely.Retention(keep=HOUR)
    )
    with pytest.raises(RetentionTooShort, match=r"^retention 1h is below the redelivery"):
        await BrokerConsumer(broker, _SyncInboxProcessor(short)).run()
    assert broker.acked == 0 and broker.outstanding == 1
    # The purge service runs in the event loop, on an async store: a sync inbox's store is
    # purged by a process of its own, and asking for it here says so.
    inbox = oncely.Inbox(oncely.MemoryStore(), consumer="orders")
    settings = ConsumerSettings(purge_every=timedelta(minutes=1))
    with pytest.raises(ConfigurationError, match=r"oncely inbox purge --every 1m"):
        await BrokerConsumer(broker, _SyncInboxProcessor(inbox), settings=settings).run()
    assert broker.acked == 0
