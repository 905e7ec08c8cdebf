"""RabbitMQ end to end, against the real broker: a quorum queue with a dead-letter exchange and
queue. The behaviours every broker shares are :class:`~tests.brokers.suite.BrokerSuite`'s; here
is how the suite reaches RabbitMQ, and what only RabbitMQ has: the queue's topology and its
delivery limit, the URL options, a producer whose message no queue takes, the delivery tag, a
delivery gone stale with its connection, and the broker application restarted mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections import Counter
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
import pytest

import oncely
from oncely.brokers import (
    BrokerLimits,
    DeadLetter,
    Delivery,
    Transport,
    cloudevent_headers,
    open_producer,
    open_transport,
)
from oncely.brokers.rabbitmq import DEFAULT_DELIVERY_LIMIT, RabbitMQ, RabbitMQProducer
from oncely.errors import BrokerError, BrokerUnavailable
from tests.brokers.common import remove_destinations, running, unique, wait_until
from tests.brokers.foreign import publish_amqp
from tests.brokers.suite import BrokerSuite, DeadCopy, Watched, body, fetch_one
from tests.services import RABBITMQ_URL, disruptive, require

pytestmark = pytest.mark.services


async def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` without blocking the event loop the consumers run on."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)} failed: {err.decode()}")
    return out.decode()


class TestRabbitMQ(BrokerSuite):
    url = RABBITMQ_URL
    producer_class = RabbitMQProducer
    shared_url_options = "connect_timeout=5&confirm_timeout=20&heartbeat=30"
    redelivers_on_connection_loss = True
    # The dead-letter copy is published with aio-pika, which makes up a message id for a
    # message that has none (oncely.brokers.rabbitmq._delivery, RabbitMQDelivery.dead_letter).
    # ------------------------------------------------------------------ the suite's interface

    def require(self) -> None:
        require("RabbitMQ", RABBITMQ_URL, 5672)

    def new_source(self) -> str:
        return unique("rmq")

    def transport(self, *, url: str | None = None, **options: Any) -> RabbitMQ:
        # No ack wait: RabbitMQ holds a delivery for its live consumer as long as it takes.
        options.pop("ack_wait", None)
        made = RabbitMQ(
            url or self.url, self.source, connection_name=self.connection_name, **options
        )
        return self.closed_after(made)

    async def publish_raw_without_id(self, payload: bytes) -> None:
        # pika sends no message_id property when none is set (aio-pika would make one up).
        properties = {"content_type": "application/json", "delivery_mode": 2}
        await publish_amqp(self.source, [(payload, properties)])

    async def dead_letters(self) -> list[DeadCopy]:
        # A copy of a message that had no id says so (the client library gives each one an id).
        return [
            DeadCopy(
                None if "x-oncely-no-message-id" in (m.headers or {}) else m.message_id,
                m.body,
                dict(m.headers or {}),
                m.content_type,
            )
            for m in await self.drain_dead()
        ]

    async def unsettled(self) -> int | None:
        """The ready messages once no consumer is left (a consumer's unacknowledged ones go
        back to the queue with it); while one reads, AMQP says nothing of those it holds."""
        ready, consumers = await self._declare(self.source)
        return None if consumers else ready

    async def consumers_reading(self) -> int:
        return (await self._declare(self.source, missing_ok=True))[1]

    async def settled(self) -> bool:
        """Once the queue has no consumer, whatever a consumer had not acknowledged is back in
        the queue, so an empty queue means all were acknowledged."""
        await wait_until(lambda: self._reading(0), what="the queue to have no consumer left")
        return await self.ready() == 0

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        assert isinstance(first.describe()["delivery_tag"], int)
        assert first.describe()["x-delivery-count"] is None
        assert again.describe()["x-delivery-count"] == 1  # the quorum queue's count

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        # RabbitMQ's default consumer_timeout (a client cannot read it) and the queue's limit.
        return BrokerLimits(ack_wait=timedelta(minutes=30), max_deliveries=DEFAULT_DELIVERY_LIMIT)

    async def delete_source(self) -> None:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            await (await connection.channel()).queue_delete(self.source)

    # ------------------------------------------------------------------ RabbitMQ's own state

    @property
    def dead(self) -> str:
        return f"{self.source}.dead"

    @property
    def connection_name(self) -> str:
        return f"oncely {self.group} {self.source}"

    async def _declare(self, name: str, *, missing_ok: bool = False) -> tuple[int, int]:
        """(ready messages, consumers) of a queue, by a passive declare."""
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            try:
                queue = await channel.declare_queue(name, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                if missing_ok:  # the consumer has not declared it yet
                    return 0, 0
                raise
            result = queue.declaration_result
            return result.message_count or 0, result.consumer_count or 0

    async def ready(self) -> int:
        return (await self._declare(self.source))[0]

    async def dead_count(self) -> int:
        return (await self._declare(self.dead))[0]

    async def drain_dead(self) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Every message in the dead-letter queue, acknowledged (so the queue ends empty)."""
        found = []
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                queue = await channel.declare_queue(self.dead, passive=True)
                while (message := await queue.get(fail=False)) is not None:
                    await message.ack()
                    found.append(message)
                queue = await channel.declare_queue(self.dead, passive=True)
                assert queue.declaration_result.message_count == 0
        return found

    async def kill_consumer_connections(self) -> int:
        """Close this test's consumer connections from the broker's side."""
        table = await rabbitmqctl(
            "-q", "--no-table-headers", "list_connections", "pid", "client_properties"
        )
        pids = [row.split("\t", 1)[0] for row in table.splitlines() if self.connection_name in row]
        for pid in pids:
            await rabbitmqctl("close_connection", pid, "oncely test: connection killed")
        return len(pids)

    # ------------------------------------------------------------------ topology

    async def test_queue_is_quorum_with_dead_letter_exchange_and_delivery_limit(self) -> None:
        made = self.transport()
        await made.open(2)
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            # Redeclaring with exactly these arguments succeeds; anything else is refused.
            channel = await connection.channel()
            await channel.declare_queue(
                self.source,
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-dead-letter-exchange": self.dead,
                    "x-delivery-limit": DEFAULT_DELIVERY_LIMIT,
                },
            )
            with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
                await channel.declare_queue(
                    self.source, durable=True, arguments={"x-queue-type": "classic"}
                )
        # A transport configured differently is told so, not left guessing.
        other = self.transport(delivery_limit=7)
        with pytest.raises(oncely.ConfigurationError, match="other arguments"):
            await other.open(1)

    async def test_r13_a_classic_queue_that_counts_no_deliveries_still_dead_letters_failures(
        self,
    ) -> None:
        """A classic queue declared by someone else (read with ``declare=False``) marks a
        message redelivered but sets no ``x-delivery-count``: the transport counts the
        redeliveries itself, so a handler that always fails is run ``max_deliveries`` times
        and the message dead-lettered, not given back for good."""
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                self.dead, aio_pika.ExchangeType.FANOUT, durable=True
            )
            await (await channel.declare_queue(self.dead, durable=True)).bind(exchange)
            await channel.declare_queue(self.source, durable=True)  # a classic queue
        attempts = 0

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal attempts
            attempts += 1
            raise RuntimeError(f"boom {attempts}")

        await self.publish("always")
        await self.publish("other")
        watched = Watched(self.transport(declare=False))
        worker = self.consumer(handler, transport=watched, max_deliveries=3)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["dead_lettered_after_retries"] == 2,
                timeout=timedelta(seconds=20),
                what="both failing messages dead-lettered",
            )
        assert attempts == 6
        assert watched.counts("always") == watched.counts("other") == [1, 2, 3]
        copies = await self.dead_letters()
        assert sorted(c.message_id or "" for c in copies) == ["always", "other"]
        assert all("failed on all 3 deliveries" in c.reason for c in copies)
        await self.assert_settled()

    async def test_declare_false_refuses_a_missing_dead_letter_exchange_at_start(self) -> None:
        """With ``declare=False`` only the dead-letter queue was checked at start. With the
        exchange missing, each dead letter made RabbitMQ close the channel (NOT_FOUND): the
        message and every other one held on the channel came back, the poison message was
        dead-lettered again, and so on for good (a classic queue has no delivery limit),
        handlers' acks failing each time. The missing exchange is named at start."""
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(self.dead, durable=True)  # the queue, no exchange
            await channel.declare_queue(self.source, durable=True)
        made = self.transport(declare=False)
        with pytest.raises(oncely.BrokerError, match=f"exchange '{self.dead}'"):
            await made.open(1)

    async def test_r10_a_handler_raising_cancelled_error_is_a_failure(self) -> None:
        await self.check_a_handler_raising_cancelled_error_is_a_failure()

    async def test_dead_letter_copy_keeps_header_names_over_128_bytes_whole(self) -> None:
        """AMQP header names are short strings of up to 255 bytes, and RabbitMQ passes them
        on; pamqp's encoder cut each at 128 bytes, so in the dead-letter copy two names that
        share their first 128 bytes became one header (one value lost) and a long name
        arrived cut, nested tables' names too. Sent here by pika, which sends them whole."""
        prefix = "x-" + "p" * 126  # 128 bytes
        headers: dict[str, Any] = {
            prefix + "-first": "1",
            prefix + "-second": "2",
            "é" * 127 + "z": "255 bytes",  # AMQP's longest name
            "nested": {"n" * 200: "deep", "list": [{"m" * 150: 7}]},
            "short": "s",
        }
        made = self.transport()
        await made.open(1)
        await publish_amqp(
            self.source, [(body("long"), {"message_id": "long", "headers": headers})]
        )
        delivery = await fetch_one(made)
        assert delivery.envelope.headers[prefix + "-second"] == "2"  # read whole
        await delivery.dead_letter(
            DeadLetter(outcome="rejected", reason="test", consumer=self.group, deliveries=1)
        )
        (copy,) = await self.dead_letters()
        kept = {k: v for k, v in copy.headers.items() if not k.startswith("x-oncely-")}
        kept.pop("x-delivery-count", None)  # the dead-letter quorum queue's own
        assert kept == headers
        assert copy.consumer == self.group and copy.outcome == "rejected"

    async def test_r2_a_key_header_sent_as_a_table_array_float_or_flag_is_refused_as_such(
        self,
    ) -> None:
        """AMQP headers hold typed values. A table or an array named as the key was dropped
        from the envelope: the key was "missing", so ``FirstOf(HeaderKey(...),
        MessageIdKey())`` keyed the message on another source without a word. A float or a
        flag became its ``str()``: ``1.0`` and ``1`` keyed two copies of one message apart.
        Each is refused naming what it is, and a handler still sees the table."""
        sent = {
            "table": {"order": "o-1"},
            "array": ["o-1", "o-2"],
            "float": 1.0,
            "flag": True,
        }
        made = self.transport()
        await made.open(len(sent) + 1)
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            for name, value in [*sent.items(), ("int", 7)]:
                message = aio_pika.Message(
                    body(name), message_id=f"m-{name}", headers={"order-id": value}
                )
                await channel.default_exchange.publish(message, routing_key=self.source)
        key = oncely.FirstOf(oncely.HeaderKey("order-id"), oncely.MessageIdKey())
        kinds = {"table": "table", "array": "array", "float": "floating", "flag": "flag"}
        for _ in range(len(sent) + 1):
            delivery = await fetch_one(made)
            name = delivery.envelope.message_id.removeprefix("m-")  # type: ignore[union-attr]
            if name == "int":
                assert key(delivery.envelope) == "7"
            else:
                with pytest.raises(oncely.InvalidKey, match=kinds[name]):
                    key(delivery.envelope)
                assert delivery.envelope.headers["order-id"] == sent[name]
            await delivery.ack()
        await made.close()

    async def test_r13_a_dead_letter_copy_left_unconfirmed_gives_the_message_back(self) -> None:
        """A dead-letter copy the broker does not confirm within ``confirm_timeout`` (a
        blocked connection, a dead-letter quorum queue without a leader) left the original
        unacknowledged on a channel that stays open: RabbitMQ never redelivered it, and it
        held a prefetch slot for good (with ``concurrency=1`` the consumer read nothing
        more), though the log said the broker would redeliver it. It is given back after a
        pause, as a copy the broker refuses is, and dead-lettered on a later delivery."""
        made = self.transport(confirm_timeout=timedelta(microseconds=1))
        await made.open(1)
        await self.publish("unconfirmed")
        delivery = await fetch_one(made)
        with pytest.raises(oncely.BrokerUnavailable, match="dead-letter exchange"):
            await delivery.dead_letter(
                DeadLetter(outcome="rejected", reason="test", consumer=self.group, deliveries=1)
            )
        again = await fetch_one(made)
        assert again.envelope.message_id == "unconfirmed"
        assert again.delivery_count == 2
        await again.ack()
        await made.close()
        await self.dead_letters()  # the copy may have been written, unconfirmed
        await self.assert_settled()

    async def test_r13_a_dead_letter_reason_over_frame_max_is_cut_not_fatal(self) -> None:
        """A handler whose error text is larger than the connection's ``frame_max`` (128 KiB
        by default): the dead-letter copy's headers (the reason among them) did not fit in
        one frame, RabbitMQ closed the whole connection (every other delivery on it given
        back), the message came again at once and ran its handler again, over and over,
        past ``max_deliveries``, until the queue's ``x-delivery-limit`` dead-lettered it
        with no reason. The reason is cut to fit: the copy lands at the first try."""
        runs = 0

        async def handler(payload: Any) -> None:
            nonlocal runs
            runs += 1
            raise RuntimeError("x" * 300_000)

        await self.publish("huge-error")
        worker = self.consumer(handler, max_deliveries=1)
        tried = ("dead_letter_failed", "dead_lettered_after_retries")
        async with running(worker):
            await wait_until(
                lambda: any(worker.counts[n] for n in tried),
                what="the failing message's dead letter tried",
            )
        assert runs == 1
        assert "settle_failed" not in worker.counts
        (copy,) = await self.dead_letters()
        assert copy.message_id == "huge-error"
        assert copy.reason.startswith("failed on all 1 deliveries; last: handler raised")
        assert copy.reason.endswith("[cut to fit the server's frame_max]")
        await self.assert_settled()

    async def test_producer_refuses_an_id_amqp_cannot_carry_naming_it(self) -> None:
        # Tried as a new user would: pamqp failed while encoding, with a TypeError that
        # named no field.
        producer = self.producer()
        with pytest.raises(oncely.ConfigurationError, match="255 bytes in a message's message_id"):
            await producer.publish(b"{}", message_id="m" * 256)
        with pytest.raises(oncely.ConfigurationError, match="correlation_id; this one has 300"):
            await producer.publish(b"{}", message_id="m", correlation_id="c" * 300)
        await producer.publish(b"{}", message_id="é" * 127)  # 254 bytes: carried

    async def test_producer_sends_header_names_over_128_bytes_whole(self) -> None:
        """The client library cut every header name at 128 bytes with a log line only: two
        names sharing their first 128 bytes arrived as one header, a value lost. AMQP
        carries up to 255 bytes; a longer name is refused naming the limit."""
        prefix = "x-" + "p" * 126
        sent = {prefix + "-first": "1", prefix + "-second": "2", "é" * 127 + "z": "3"}
        producer = self.producer()
        with pytest.raises(oncely.ConfigurationError, match="255 bytes in a header name"):
            await producer.publish(body("m"), message_id="m", headers={"n" * 256: "x"})
        await producer.publish(body("m"), message_id="m", headers=sent)
        made = self.transport()
        await made.open(1)
        delivery = await fetch_one(made)
        assert delivery.envelope.headers == sent
        await delivery.ack()

    async def test_producer_refuses_headers_over_frame_max_naming_it(self) -> None:
        """Headers larger than the connection's ``frame_max`` (128 KiB by default) made
        RabbitMQ close the producer's connection, raised as ``BrokerUnavailable``: an
        outage, which a caller retries for good. It is refused before anything is sent,
        naming the limit, and the connection is kept."""
        producer = self.producer()
        with pytest.raises(oncely.ConfigurationError, match="frame_max"):
            await producer.publish(body("big"), message_id="big", headers={"h": "x" * 200_000})
        await producer.publish(body("small"), message_id="small")
        made = self.transport()
        await made.open(1)
        delivery = await fetch_one(made)
        assert delivery.envelope.message_id == "small"
        await delivery.ack()

    async def test_producer_refuses_a_message_no_queue_takes(self) -> None:
        producer = self.producer(declare=False)
        with pytest.raises(oncely.BrokerError, match="no queue"):
            await producer.publish(body("lost"), message_id="m")

    async def test_a_message_is_never_held_past_half_the_stated_consumer_timeout(self) -> None:
        """RabbitMQ has no delayed requeue, so a retry (or an ``in_flight`` copy, held up to
        5 minutes while another worker's lease runs) keeps the message unacknowledged for
        the delay. Past the server's ``consumer_timeout`` RabbitMQ closes the channel, and
        every message on it comes back. A transport told the server's timeout (``ack_wait``)
        holds a message at most half of it."""
        made = self.transport(consumer_timeout=timedelta(seconds=4))
        await made.open(1)
        await self.publish("held")
        delivery = await fetch_one(made)
        await delivery.retry(timedelta(minutes=5))
        again = await fetch_one(made)  # tries for about 25 s
        assert again.envelope.message_id == "held"
        assert again.delivery_count == 2
        await again.ack()
        await made.close()
        await self.assert_settled()

    async def test_r13_broker_delivery_limit_is_a_safety_net_without_a_reason(self) -> None:
        """Past ``x-delivery-limit`` the quorum queue dead-letters by itself, with no
        ``x-oncely-*`` reason: that is why the limit sits above ``max_deliveries``."""
        made = self.transport(delivery_limit=2)
        producer = self.producer(delivery_limit=2)
        await made.open(1)
        await producer.publish(body("x"), message_id="x")
        counts = []
        while found := await made.fetch(1, timedelta(seconds=1)):
            counts.append(found[0].delivery_count)
            await found[0].retry(timedelta(0))
        assert counts == [1, 2, 3]
        await wait_until(lambda: _equals(self.dead_count(), 1), what="the broker's dead letter")
        (dead,) = await self.dead_letters()
        assert dead.message_id == "x"
        assert "x-oncely-reason" not in dead.headers
        assert await self.ready() == 0

    # ------------------------------------------------------------------ CloudEvents

    async def test_r3_an_event_published_with_the_amqp_binding_round_trips(self) -> None:
        """R3: ``cloudevent_headers(binding="amqp")`` names the attributes as the AMQP binding
        does (``cloudEvents_``), so a plain AMQP client finds them; oncely's consumer keys the
        event by its (source, id) and takes a copy under another message id as a duplicate."""
        ce = cloudevent_headers(
            source="/shop", event_type="order.paid", event_id="e1", binding="amqp"
        )
        await self.publish("plain", message_id="m-0", headers=ce)
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.source, passive=True)
            message = await queue.get(timeout=5)
            await message.ack()
        sent = dict(message.headers or {})
        assert sent["cloudEvents_specversion"] == "1.0"
        assert sent["cloudEvents_source"] == "/shop"
        assert sent["cloudEvents_id"] == "e1"
        assert sent["cloudEvents_type"] == "order.paid"
        assert not any(name.lower().startswith("ce-") for name in sent)
        await self.publish("e1", message_id="m-1", headers=ce)
        await self.publish("e1", message_id="m-2", headers=ce)
        worker = self.consumer(self.apply_in, mode="transactional", key=oncely.CloudEventsKey())
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] + worker.counts["duplicate"] == 2,
                what="both copies of the event",
            )
        assert worker.counts == Counter({"processed": 1, "duplicate": 1})
        assert self.ledger.counts() == {"e1": 1}
        assert await self.dead_letters() == []
        await self.assert_settled()

    # ------------------------------------------------------------------ connections

    async def test_stale_delivery_after_a_broker_side_close_raises_broker_unavailable(
        self,
    ) -> None:
        """The broker closes the consumer's connection (``rabbitmqctl close_connection``): the
        transport reconnects, the message comes again, and the delivery held from before
        cannot be acknowledged any more (its tag belonged to the closed channel)."""
        made = self.transport()
        await made.open(1)
        await self.publish("stale")
        (held,) = await made.fetch(1, timedelta(seconds=10))
        assert await self.kill_consumer_connections() == 1
        with pytest.raises(oncely.BrokerUnavailable):
            for _ in range(100):  # until the transport notices the loss
                await made.fetch(1, timedelta(milliseconds=100))
        again = await fetch_one(made)  # reconnected
        assert again.envelope.message_id == held.envelope.message_id
        assert again.delivery_count == 2
        with pytest.raises(oncely.BrokerUnavailable):
            await held.ack()
        await again.ack()
        await made.close()
        await self.assert_settled()

    @pytest.mark.slow
    @disruptive("stops and starts the machine's RabbitMQ application")
    async def test_r1_r8_broker_restart_mid_run_loses_nothing_and_applies_once(self) -> None:
        """``rabbitmqctl stop_app`` / ``start_app`` under a running consumer whose handlers
        hold their transactions: the quorum queue keeps its messages; the consumer reconnects
        by itself and finishes them, then takes new ones; the handlers that ran across the
        restart commit, their acks fail, and their copies come back as duplicates."""
        resume = asyncio.Event()
        calls = 0

        async def apply(tx: Any, payload: Any) -> None:
            nonlocal calls
            calls += 1
            if calls > 10:  # from the 11th on, handlers hold their transaction until the restart
                await resume.wait()
            await self.apply_in(tx, payload)

        before, after = 40, 10
        producer = self.producer()
        for n in range(before):
            await producer.publish(body(f"r{n}"), message_id=f"r{n}")
        worker = self.consumer(apply, mode="transactional")
        concurrency = worker.settings.concurrency
        try:
            async with running(worker) as task:
                await wait_until(
                    lambda: calls == 10 + concurrency, what="every handler slot to be mid-run"
                )
                try:
                    await rabbitmqctl("stop_app")
                finally:
                    await _start_app()
                resume.set()
                for n in range(after):  # the producer reconnects too
                    await producer.publish(body(f"s{n}"), message_id=f"s{n}")
                await wait_until(
                    lambda: len(self.ledger.counts()) == before + after,
                    timeout=timedelta(seconds=90),
                    what="every message after the restart",
                )
                await wait_until(
                    lambda: worker.counts["duplicate"] >= concurrency,
                    what="the copies redelivered after the restart to be acked as duplicates",
                )
                assert not task.done()
        finally:
            resume.set()
        expected = {f"r{n}": 1 for n in range(before)} | {f"s{n}": 1 for n in range(after)}
        assert self.ledger.counts() == expected
        assert worker.counts["settle_failed"] >= 1  # acks on the channel the restart closed
        await self.assert_settled()
        assert await self.dead_count() == 0


async def _equals(value: Any, expected: int) -> bool:
    return await value == expected


async def _start_app() -> None:
    """Start the RabbitMQ application and wait until it answers again (always run)."""
    subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + 120
    while True:
        ping = await asyncio.create_subprocess_exec(
            "rabbitmq-diagnostics",
            "-q",
            "check_running",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        if await ping.wait() == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError("RabbitMQ did not come back after start_app")
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------- configuration


def test_url_options_are_checked() -> None:
    with pytest.raises(oncely.ConfigurationError, match="delivery_limit"):
        open_transport(f"{RABBITMQ_URL}?prefetch=3", "q", group="g")
    made = open_transport(
        f"{RABBITMQ_URL}?delivery_limit=0&declare=false&heartbeat=5", "q", group="g"
    )
    assert isinstance(made, RabbitMQ)
    assert made.topology.delivery_limit is None
    assert made.topology.dead_letter == "q.dead"
    assert made.extend_every is None
    with pytest.raises(oncely.ConfigurationError):
        RabbitMQ(RABBITMQ_URL, "q", dead_letter="q")
    with pytest.raises(oncely.ConfigurationError):
        open_producer(f"{RABBITMQ_URL}?delivery_limit=-1", "q")


# ---------------------------------------------------------------------- refusals


async def test_a_refusal_at_start_is_final_but_once_let_in_it_is_ridden_out() -> None:
    """Wrong credentials at start raise :class:`BrokerError` (retrying them forever helps no
    one); the same refusal after the broker has let the consumer in once (a password being
    rotated, a broker still starting) is :class:`BrokerUnavailable`, which the consumer
    loop rides out, and the transport comes back once the broker lets it in again."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    user, queue = unique("oncely_user"), unique("rmq_refused")
    parts = urlsplit(RABBITMQ_URL)
    vhost = unquote(parts.path[1:]) or "/"

    def url(password: str) -> str:
        path = parts.path if parts.path not in ("", "/") else "/"
        return f"amqp://{user}:{password}@{parts.hostname}:{parts.port or 5672}{path}"

    with pytest.raises(BrokerError, match="ACCESS_REFUSED") as refused:
        await RabbitMQ(url("pw-1"), queue).open(1)  # no such user yet
    assert not isinstance(refused.value, BrokerUnavailable)
    await rabbitmqctl("add_user", user, "pw-1")
    transport = RabbitMQ(url("pw-1"), queue, connection_name=f"oncely {user}")
    try:
        await rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        await transport.open(1)
        await rabbitmqctl("change_password", user, "pw-2")
        table = await rabbitmqctl(
            "-q", "--no-table-headers", "list_connections", "pid", "client_properties"
        )
        pids = [row.split("\t", 1)[0] for row in table.splitlines() if user in row]
        assert pids, table
        for pid in pids:
            await rabbitmqctl("close_connection", pid, "oncely test: password rotated")
        await wait_until(lambda: transport._session is None or transport._session.lost is not None)
        with pytest.raises(BrokerUnavailable, match="connection to RabbitMQ was lost"):
            await transport.fetch(1, timedelta(milliseconds=50))
        with pytest.raises(BrokerUnavailable, match="ACCESS_REFUSED"):
            await transport.fetch(1, timedelta(milliseconds=50))  # refused, not final
        await rabbitmqctl("change_password", user, "pw-1")
        assert await transport.fetch(1, timedelta(milliseconds=50)) == []  # back in
        assert transport._session is not None and transport._session.lost is None
    finally:
        await transport.close()
        await rabbitmqctl("delete_user", user)
        await remove_destinations(RABBITMQ_URL, queue)
