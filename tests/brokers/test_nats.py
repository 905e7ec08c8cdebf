"""NATS JetStream end to end, against a real nats-server: a subject captured by a stream, read
by a durable pull consumer, and a dead-letter stream beside it. The behaviours every broker
shares are :class:`~tests.brokers.suite.BrokerSuite`'s; here is how the suite reaches
JetStream, and what only it has: the configuration, the stream's duplicate window (which drops
a producer retry before any consumer sees it, R14, R23), the consumer's own ``max_deliver``,
the messages nats-py buffered given back at a stop, and the server killed and restarted (a
nats-server of the test's own: a port and store directory per test, never the shared one).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import nats
import nats.js.api
import nats.js.errors
import pytest

import oncely
from oncely.brokers import (
    BrokerLimits,
    DeadLetter,
    Delivery,
    Transport,
    open_producer,
    open_transport,
)
from oncely.brokers.nats import JetStream, JetStreamProducer
from tests.brokers.common import (
    free_port,
    holder_fails,
    key_held,
    publish_until_confirmed,
    running,
    unique,
    wait_until,
)
from tests.brokers.foreign import header_lines, publish_nats, read_nats_stream
from tests.brokers.suite import BrokerSuite, DeadCopy, body, fetch_one
from tests.services import NATS_URL, REQUIRED, require

pytestmark = pytest.mark.services


class PrivateNats:
    """A nats-server of this test's own: a free port and a store directory that outlive a
    kill, so the stream and the consumer's state survive a restart."""

    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.store = store
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError("the private nats-server did not start") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)
        self.proc = None


class TestJetStream(BrokerSuite):
    url = NATS_URL
    producer_class = JetStreamProducer
    shared_url_options = "timeout=5&connect_timeout=5&reconnect_wait=1"
    consumer_url_options = "ack_wait=30&max_deliver=4&max_ack_pending=50"
    retries_reach_the_consumer = False  # the stream's duplicate window drops them (R14)

    # ------------------------------------------------------------------ the suite's interface

    def require(self) -> None:
        require("NATS", NATS_URL, 4222)

    def new_source(self) -> str:
        return f"{unique('oncely_nats')}.orders"

    def transport(self, *, url: str | None = None, **options: Any) -> JetStream:
        options.setdefault("ack_wait", timedelta(seconds=5))
        made = JetStream(url or self.url, self.source, group=self.group, **options)
        return self.closed_after(made)

    async def publish_raw_without_id(self, payload: bytes) -> None:
        # No Nats-Msg-Id (nor Oncely-Message-Id) header, over the raw client protocol.
        await publish_nats(self.source, [([(b"Content-Type", b"application/json")], payload)])

    async def dead_letters(self) -> list[DeadCopy]:
        try:
            found = await read_nats_stream(f"{self.source}.dead")
        except LookupError:
            return []  # no dead-letter stream yet
        copies = []
        for block, data in found:
            headers = {name.decode(): value.decode() for name, value in header_lines(block)}
            copies.append(
                DeadCopy(
                    message_id=headers.get("Oncely-Message-Id"),
                    body=data,
                    headers=headers,
                    content_type=headers.get("Content-Type"),
                )
            )
        return copies

    async def unsettled(self) -> int:
        info = await self.consumer_info()
        return int(info.num_ack_pending + info.num_pending)

    async def consumers_reading(self) -> int:
        """Pull requests waiting: each consumer keeps one open while it reads."""
        try:
            return int((await self.consumer_info()).num_waiting or 0)
        except nats.js.errors.NotFoundError:
            return 0  # not declared yet

    async def deliveries_made(self) -> int | None:
        return int((await self.consumer_info()).delivered.consumer_seq)

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        assert again.describe()["stream"] == first.describe()["stream"] == self.stream
        assert again.describe()["stream_seq"] == first.describe()["stream_seq"]
        assert again.describe()["consumer_seq"] > first.describe()["consumer_seq"]  # type: ignore[operator]

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        # The consumer's ack wait (5 s here) and max_deliver (20 by default); the stream
        # oncely creates has no max_age.
        return BrokerLimits(ack_wait=timedelta(seconds=5), max_deliveries=20)

    async def delete_source(self) -> None:
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().delete_stream(self.stream)  # its consumer goes with it
        finally:
            await nc.close()

    # ------------------------------------------------------------------ JetStream's own state

    @pytest.fixture
    def private_nats(self, _one_test: None, tmp_path: Path) -> PrivateNats:
        """A nats-server of the test's own, killed after everything the test opened on it
        was closed."""
        if shutil.which("nats-server") is None:
            reason = "nats-server is not installed; the restart tests run a private one"
            if REQUIRED:
                pytest.fail(reason)
            pytest.skip(reason)
        server = PrivateNats(tmp_path / "jetstream")
        server.start()
        self.after(lambda: asyncio.to_thread(server.kill))
        return server

    @property
    def stream(self) -> str:
        return self.source.replace(".", "_")

    @property
    def dead_stream(self) -> str:
        return f"{self.stream}_dead"

    async def consumer_info(self, url: str | None = None) -> nats.js.api.ConsumerInfo:
        nc = await nats.connect(url or self.url)
        try:
            return await nc.jetstream().consumer_info(self.stream, self.group)
        finally:
            await nc.close()

    async def settled_at(self, url: str) -> bool:
        info = await self.consumer_info(url)
        return info.num_ack_pending == info.num_pending == 0

    def jetstream_producer(self, **options: Any) -> JetStreamProducer:
        return cast(JetStreamProducer, self.producer(**options))

    # ------------------------------------------------------------------ dead letters

    async def test_a_dead_letter_copy_near_max_payload_is_written_with_its_reason_cut(
        self,
    ) -> None:
        """A message refused as it came whose body is close to the server's ``max_payload``:
        its copy (the body, the original headers and the ``x-oncely-*`` ones) would be
        larger than the server takes, and the server closes a connection that publishes
        such a message, so the copy is never written, every redelivery closes the
        connection again, and after ``max_deliver`` deliveries JetStream drops the message
        unwritten. The reason is cut instead: the copy lands, body whole, connection kept."""
        nc = await nats.connect(self.url)
        max_payload = nc.max_payload
        await nc.close()
        big = b'"' + b"x" * (max_payload - 352) + b'"'  # with its headers, it fits
        await self.producer().publish(big, message_id="big")
        await self.publish("small")
        worker = self.consumer(self.apply, max_body_bytes=1000)
        async with running(worker):
            await wait_until(
                lambda: bool(worker.counts["rejected"] and worker.counts["processed"]),
                what="the big message refused and the small one processed",
            )

            async def copied() -> bool:
                return bool(await self.dead_letters())

            await wait_until(copied, timeout=timedelta(seconds=20), what="the dead-letter copy")
        [copy] = await self.dead_letters()
        assert (copy.message_id, copy.body, copy.outcome) == ("big", big, "rejected")
        assert copy.reason.startswith(f"the body is {len(big)} bytes, over the limit of 1000")
        assert "dead_letter_failed" not in worker.counts
        assert "settle_failed" not in worker.counts
        assert self.ledger.counts() == {"small": 1}
        await self.assert_settled()

    async def test_r2_an_id_or_header_nats_would_alter_is_refused_by_the_producer(self) -> None:
        """nats-py strips the white space around a header value and turns line breaks into
        spaces: ``order-7 `` and ``order-7`` (or ``a\nb`` and ``a b``) would reach the
        consumer as one key, the second message acknowledged as a duplicate of the first
        when their bodies match. The producer refuses such a value instead of sending
        another one."""
        producer = self.jetstream_producer()
        for message_id in ("order-7 ", " order-7", "order\n7", "order\r7"):
            with pytest.raises(oncely.ConfigurationError, match="NATS headers cannot carry"):
                await producer.publish(body("x"), message_id=message_id)
        with pytest.raises(oncely.ConfigurationError, match="Correlation-Id header"):
            await producer.publish(body("x"), message_id="m", correlation_id="c\n")
        with pytest.raises(oncely.ConfigurationError, match="ce-id header"):
            await producer.publish(body("x"), message_id="m", headers={"ce-id": "e-1 "})
        await producer.publish(body("kept"), message_id="order 7")  # inner spaces are fine
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 1, what="the one message")
        assert self.ledger.counts() == {"kept": 1}

    async def test_r10_a_handler_raising_cancelled_error_is_a_failure(self) -> None:
        await self.check_a_handler_raising_cancelled_error_is_a_failure()

    async def test_a_message_with_jetstream_publish_headers_is_dead_lettered(self) -> None:
        """A producer that publishes with JetStream's expectations (``Nats-Expected-Stream``,
        ``Nats-Expected-Last-Sequence``): the dead-letter copy carried them as they were, so
        the dead-letter stream refused it ('expected stream does not match'), every attempt,
        and after ``max_deliver`` deliveries JetStream dropped the message, never
        dead-lettered. The copy now carries them renamed, every byte kept."""
        await self.transport().open(1)  # makes the stream, and the consumer
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            await js.publish(
                self.source,
                b"not json",
                headers={
                    "Nats-Msg-Id": "e-1",
                    "Nats-Expected-Stream": self.stream,
                    "Nats-Expected-Last-Sequence": "0",
                },
            )
        finally:
            await nc.close()
        worker = self.consumer(self.apply, transport=self.transport(max_deliver=3))
        async with running(worker):

            async def copied() -> bool:
                return bool(await self.dead_letters())

            await wait_until(copied, timeout=timedelta(seconds=20), what="the dead-letter copy")
        [copy] = await self.dead_letters()
        assert (copy.body, copy.outcome) == (b"not json", "rejected")
        assert copy.headers["x-oncely-original-Nats-Expected-Stream"] == self.stream
        assert copy.headers["x-oncely-original-Nats-Expected-Last-Sequence"] == "0"
        assert not any(name.startswith("Nats-Expected") for name in copy.headers)
        assert "dead_letter_failed" not in worker.counts
        await self.assert_settled()

    async def test_a_message_over_max_payload_is_refused_as_an_error_not_an_outage(
        self,
    ) -> None:
        """A body over the server's ``max_payload``, or one that its headers take over it:
        nats-py checks the body alone and the server closes the connection on the rest, so
        both came back as BrokerUnavailable, which a caller retries (the same id is safe to
        retry) for good. Both are a BrokerError, unsent, and the producer goes on."""
        producer = self.jetstream_producer()
        await producer.publish(body("first"), message_id="first")  # connected
        nc = await nats.connect(self.url)
        max_payload = nc.max_payload
        await nc.close()
        for size in (max_payload + 1, max_payload - 20):
            with pytest.raises(oncely.BrokerError, match="max_payload") as refused:
                await producer.publish(b"x" * size, message_id=f"big-{size}")
            assert not isinstance(refused.value, oncely.BrokerUnavailable)
        await producer.publish(body("after"), message_id="after")
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 2, what="the two messages")
        assert self.ledger.counts() == {"first": 1, "after": 1}

    # ------------------------------------------------------------------ configuration

    async def test_existing_stream_capturing_the_dead_letter_subject_is_refused(self) -> None:
        base = self.source.rpartition(".")[0]
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name=f"{base}_all", subjects=[f"{base}.>"])
            made = self.transport()  # dead letter: <base>.orders.dead, inside <base>.>
            with pytest.raises(oncely.ConfigurationError, match="captures the dead-letter"):
                await made.open(1)
        finally:
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(f"{base}_all")
            await nc.close()

    async def test_r13_the_streams_max_age_is_part_of_the_horizon(self) -> None:
        """A stream that keeps messages for an hour: any consumer of it may be handed a
        message for an hour, so the horizon counts that hour as the message's time-to-live."""
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().add_stream(
                name=self.stream, subjects=[self.source], max_age=3600.0
            )
        finally:
            await nc.close()
        await self.publish("order-1")
        transport = self.transport()
        consumer = self.consumer(
            self.apply,
            inbox=self.inboxes(
                "two_phase", 1, retention=oncely.Retention(keep=timedelta(minutes=30))
            )[0],
            transport=transport,
            resubmit_window=timedelta(0),
        )
        with pytest.raises(oncely.RetentionTooShort, match=r"message_ttl=1h\)") as refused:
            await asyncio.wait_for(consumer.run(), 30)
        assert transport.limits.message_ttl == timedelta(hours=1)
        # 3 deliveries x (ack wait 5 s + 200 ms backoff) + the stream's hour
        assert consumer.horizon.total == timedelta(hours=1, seconds=15.6)
        assert "retention 30m is below the redelivery horizon" in str(refused.value)
        assert self.ledger.counts() == {}

    # ------------------------------------------------------------------ the duplicate window

    async def test_a_r14_r23_producer_retries_window_then_inbox(self) -> None:
        """Within the stream's duplicate window a retry with the same Nats-Msg-Id is dropped by
        JetStream (PubAck.duplicate); a retry after the window is stored again and the inbox
        answers it ``duplicate`` (the window is a complement only, R14)."""
        producer = self.jetstream_producer(duplicate_window=timedelta(seconds=2))
        first = await producer.send(body("order-1"), message_id="order-1")
        retries = [await producer.send(body("order-1"), message_id="order-1") for _ in range(2)]
        assert not first.duplicate
        assert [ack.duplicate for ack in retries] == [True, True]
        assert {ack.seq for ack in retries} == {first.seq}
        # A retry the window cannot catch: the producer came back after the window had passed.
        late = await producer.send(body("order-1"), message_id="order-1")
        while late.duplicate:
            await asyncio.sleep(0.2)
            late = await producer.send(body("order-1"), message_id="order-1")
        assert late.seq != first.seq
        await producer.publish(body("order-2"), message_id="order-2")
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: len(self.ledger.counts()) == 2, what="both orders")
            await wait_until(lambda: worker.counts["duplicate"] == 1, what="the late retry")
        assert self.ledger.counts() == {"order-1": 1, "order-2": 1}
        assert worker.counts["processed"] == 2
        assert worker.counts["duplicate"] == 1
        await self.assert_settled()

    async def test_a_r20_a_reused_id_within_the_window_reaches_the_consumer_as_a_conflict(
        self,
    ) -> None:
        """The window drops a retry (same id, same body), but oncely's producer never lets it
        drop the same id sent with another body: ``Nats-Msg-Id`` carries the body's hash, so
        the reuse is stored and the consumer dead-letters it as a ``key_conflict`` (R20 step
        6) instead of it vanishing before any consumer sees it."""
        producer = self.jetstream_producer(duplicate_window=timedelta(minutes=1))
        first = await producer.send(body("order-9", total=10), message_id="order-9")
        retry = await producer.send(body("order-9", total=10), message_id="order-9")
        reuse = await producer.send(body("order-9", total=999), message_id="order-9")
        assert not first.duplicate and retry.duplicate and not reuse.duplicate
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["key_conflict"] == 1, what="the conflict")
        assert self.ledger.counts() == {"order-9": 1}
        (copy,) = await self.dead_letters()
        assert copy.outcome == "key_conflict"
        assert copy.message_id == "order-9" and json.loads(copy.body)["total"] in (10, 999)
        await self.assert_settled()

    async def test_a_dead_letter_copy_keeps_repeated_header_lines(self) -> None:
        """A NATS header name may repeat (``X-Tag: a``, ``X-Tag: b``). nats-py reads the
        headers into a dict, so the dead-letter copy kept the last line of a repeated name and
        lost the others. The lines of a repeated name now travel exact and in order in
        ``x-oncely-raw-headers``; the envelope still reads the last one."""
        made = self.transport()
        await made.open(1)
        sent = [
            (b"Nats-Msg-Id", b"rep-1"), (b"X-Tag", b"a"), (b"X-One", b"1"), (b"X-Tag", b"b"),
            (b"X-Tag", b"c"),
        ]  # fmt: skip
        await publish_nats(self.source, [(sent, b"{not json")])
        delivery = await fetch_one(made)
        assert delivery.envelope.headers["X-Tag"] == "c"
        why = DeadLetter(outcome="rejected", reason="test", consumer=self.group, deliveries=1)
        await delivery.dead_letter(why)
        ((block, data),) = await read_nats_stream(f"{self.source}.dead")
        lines = header_lines(block)
        assert (b"X-One", b"1") in lines and (b"Nats-Msg-Id", b"rep-1") in lines
        assert b"X-Tag" not in dict(lines)
        raw = dict(lines)[b"x-oncely-raw-headers"]
        assert header_lines(base64.b64decode(raw)) == [(b"X-Tag", v) for v in (b"a", b"b", b"c")]
        assert data == b"{not json"

    # ------------------------------------------------------------------ max_deliver

    async def test_e_r13_broker_max_deliver_below_the_loop_limit_dead_letters(self) -> None:
        """The consumer's max_deliver (2) is below ConsumerSettings.max_deliveries (5): on the
        broker's last delivery a give-back dead-letters instead of stranding the message. The
        copy names the inbox's consumer, as every other dead letter does: it named the
        JetStream consumer (the group), another name whenever the two differ."""
        await self.publish("stuck")

        async def handler(payload: dict[str, Any]) -> None:
            raise RuntimeError("always")

        inbox = self.inbox_named("ledger-writer")
        worker = self.consumer(
            handler, transport=self.transport(max_deliver=2), inbox=inbox, max_deliveries=5
        )
        async with running(worker):
            await wait_until(lambda: worker.counts["failed"] == 2, what="two failures")
            await wait_until(self.settled, what="nothing pending")
        (copy,) = await self.dead_letters()
        assert "max_deliver" in copy.reason
        assert copy.deliveries == "2"
        assert copy.consumer == "ledger-writer"
        assert self.ledger.counts() == {}
        await self.assert_settled()

    async def test_e_r13_give_backs_and_failures_together_stop_at_max_deliver(self) -> None:
        """``max_deliveries`` (5) counts failures, not the give-backs of a copy that met a
        running one; the consumer's ``max_deliver`` (6) still counts both. A copy given back
        at least 3 times while another worker holds its key, then failing each run, reaches
        ``max_deliver`` before its 5th failure: the give-back asked for on that last delivery
        dead-letters it with the broker limit's reason, never strands it unacknowledged."""
        (inbox,) = self.inboxes("two_phase", 1)
        runs = 0

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal runs
            runs += 1
            raise RuntimeError("always")

        worker = self.consumer(
            handler, inbox=inbox, transport=self.transport(max_deliver=6), max_deliveries=5
        )
        async with key_held(inbox, "stuck", then=holder_fails) as holder:
            await self.publish("stuck")
            async with running(worker):
                await wait_until(lambda: worker.counts["in_flight"] >= 4, what="4 in_flight")
                holder.release()
                await wait_until(self.settled, what="nothing pending")
        in_flight = worker.counts["in_flight"]
        # The copy held when the key was released ran on that delivery (unless it was released
        # in the moment between a give-back and the next delivery): one give-back fewer.
        assert runs in (7 - in_flight, 6 - in_flight) and runs < 5, (runs, in_flight)
        assert worker.counts["failed"] == runs
        (copy,) = await self.dead_letters()
        assert "max_deliver" in copy.reason, copy.reason
        assert copy.deliveries == "6"
        assert self.ledger.counts() == {}
        await self.assert_settled()

    async def test_e_r13_a_dead_letter_failing_on_the_last_delivery_is_tried_again(self) -> None:
        """On the consumer's last delivery (``max_deliver``) a failing message is
        dead-lettered; when that copy cannot be written (the dead-letter stream gone, full,
        or without a leader for a moment) the message was left unsettled and JetStream, past
        ``max_deliver``, never delivered it again: dropped with no dead letter, while the log
        said the broker would redeliver it. It is kept (``+WPI``) and its copy tried again
        until written."""
        await self.publish("last")
        runs = 0

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal runs
            runs += 1
            if runs == 2:  # the broker's last delivery: the dead-letter stream goes away
                nc = await nats.connect(self.url)
                try:
                    await nc.jetstream().delete_stream(self.dead_stream)
                finally:
                    await nc.close()
            raise RuntimeError("always")

        transport = self.transport(max_deliver=2, ack_wait=timedelta(seconds=2))
        worker = self.consumer(handler, transport=transport, max_deliveries=5)

        async def copied() -> bool:
            return bool(await self.dead_letters())

        async with running(worker):
            await wait_until(lambda: worker.counts["failed"] == 2, what="two failures")
            await wait_until(copied, timeout=timedelta(seconds=30), what="the dead letter")
            await wait_until(self.settled, what="nothing pending")
        (copy,) = await self.dead_letters()
        assert "max_deliver" in copy.reason
        assert runs == 2
        await self.assert_settled()

    async def test_r13_a_consumer_deleted_mid_run_resumes_after_what_it_acked(self) -> None:
        """An operator deletes the durable consumer (not the stream) under a running
        worker: it was declared again reading the stream from its start, so every message
        the stream still kept was delivered again. Those the inbox still had records of were
        duplicates; those older than its retention (a stream without ``max_age`` keeps them
        for good) ran their handlers a second time. It is declared again starting after the
        last message the consumer had acknowledged."""
        for key in ("a", "b", "c"):
            await self.publish(key)
        inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer=self.group)
        transport = self.transport()
        worker = self.consumer(self.apply, inbox=inbox, transport=transport)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 3, what="the first three")
            await wait_until(  # the idle worker looks at its consumer every few seconds
                lambda: transport.ack_floor == 3, what="the acks seen"
            )
            for key in ("a", "b", "c"):  # past the inbox's retention
                assert await inbox.forget(key)
            nc = await nats.connect(self.url)
            try:
                await nc.jetstream().delete_consumer(self.stream, self.group)
            finally:
                await nc.close()
            await wait_until(
                self.reading_again,
                timeout=timedelta(seconds=30),
                what="the consumer declared again",
            )
            await self.publish("d")
            await wait_until(lambda: self.ledger.counts().get("d") == 1, what="the new message")
        assert self.ledger.counts() == {"a": 1, "b": 1, "c": 1, "d": 1}
        await self.assert_settled()

    # ------------------------------------------------------------------ graceful stop

    async def test_stop_gives_back_fetched_messages_no_handler_started(self) -> None:
        """Messages fetched from the server but never handed to a handler are given back
        (-NAK) at a graceful stop, so another consumer gets them at once rather than after
        ack_wait; the delivery whose handler is running is left alone and settled after the
        stop."""
        ack_wait = timedelta(seconds=60)
        producer = self.producer()
        first = self.transport(ack_wait=ack_wait)
        await first.open(8)
        await producer.publish(body("started"), message_id="started")
        [started] = await first.fetch(8, timedelta(milliseconds=500))  # its handler "runs"
        # A fetch abandoned while it waits leaves its pull request open: what arrives for it
        # lands in nats-py's buffer, fetched from the server and never handed out.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first.fetch(8, timedelta(seconds=30)), 0.3)
        keys = [f"buffered-{i}" for i in range(3)]
        for key in keys:
            await producer.publish(body(key), message_id=key)

        async def some_buffered() -> bool:
            info = await self.consumer_info()
            unacked, undelivered = info.num_ack_pending, info.num_pending
            return unacked >= 2 and unacked + undelivered == 1 + len(keys)

        await wait_until(some_buffered, what="messages delivered to the first consumer's buffer")
        await asyncio.sleep(0.2)  # let whatever else the server sends for that pull arrive
        await first.stop()
        second = self.consumer(
            self.apply_in, mode="transactional", transport=self.transport(ack_wait=ack_wait)
        )
        async with running(second):
            # Far sooner than ack_wait (60 s): given back, not left to time out.
            await wait_until(
                lambda: len(self.ledger.counts()) == len(keys),
                timeout=timedelta(seconds=15),
                what="the buffered messages",
            )
            await started.ack()  # the running handler finishes after the stop
            await wait_until(self.settled, what="nothing pending")
        assert self.ledger.counts() == dict.fromkeys(keys, 1)  # "started" was never given back
        assert second.counts["processed"] == len(keys)
        await self.assert_settled()

    # ------------------------------------------------------------------ f. restarts

    @pytest.mark.slow
    async def test_f_r1_server_killed_and_restarted_mid_run(
        self, private_nats: PrivateNats
    ) -> None:
        url = private_nats.url
        producer = self.producer(url=url)
        first = [f"k{i:03}" for i in range(60)]
        for key in first:
            await publish_until_confirmed(producer, body(key), key)

        async def handler(tx: Any, payload: dict[str, Any]) -> None:
            await asyncio.sleep(0.02)
            await self.apply_in(tx, payload)

        made = self.transport(url=url, ack_wait=timedelta(seconds=2))
        worker = self.consumer(handler, mode="transactional", transport=made)
        async with running(worker):
            await wait_until(lambda: len(self.ledger.counts()) >= 15, what="a quarter of them")
            private_nats.kill(signal.SIGKILL)
            await wait_until(lambda: not made.connected, what="the consumer to notice")
            await asyncio.sleep(0.5)  # a few fetches fail while the server is away
            private_nats.start()
            later = [f"k{i:03}" for i in range(60, 80)]
            for key in later:
                await publish_until_confirmed(producer, body(key), key)
            await wait_until(lambda: len(self.ledger.counts()) == 80, what="every message")
            await wait_until(lambda: self.settled_at(url), what="nothing pending")
        assert self.ledger.counts() == dict.fromkeys(first + later, 1)
        assert worker.counts["processed"] == 80

    @pytest.mark.slow
    async def test_f_fetch_and_ack_while_the_server_is_down(
        self, private_nats: PrivateNats
    ) -> None:
        """The server itself stops (SIGTERM) with a delivery held: fetch and ack raise
        BrokerUnavailable; after the restart, from its store, the unacknowledged message
        comes back and is acknowledged."""
        made = self.transport(url=private_nats.url, ack_wait=timedelta(seconds=1))
        await made.open(4)
        await self.producer(url=private_nats.url).publish(body("x"), message_id="x")
        [delivery] = await made.fetch(4, timedelta(seconds=2))
        assert delivery.envelope.message_id == "x" and delivery.delivery_count == 1
        private_nats.kill(signal.SIGTERM)
        await wait_until(lambda: not made.connected, what="the connection to drop")
        with pytest.raises(oncely.BrokerUnavailable):
            await delivery.ack()
        with pytest.raises(oncely.BrokerUnavailable):
            await made.fetch(4, timedelta(milliseconds=300))
        private_nats.start()
        copy = await fetch_one(made)
        assert copy.envelope.message_id == "x" and (copy.delivery_count or 0) >= 2
        await copy.ack()
        await wait_until(lambda: self.settled_at(private_nats.url), what="nothing pending")


# ---------------------------------------------------------------------- configuration


def test_registry_opens_jetstream_for_nats_urls() -> None:
    transport = open_transport(
        "nats://127.0.0.1:4222?max_deliver=7", "a.b", group="g", ack_wait=timedelta(seconds=9)
    )
    assert isinstance(transport, JetStream)
    assert transport.dead_letter == "a.b.dead"
    assert transport.max_deliver == 7
    assert transport.extend_every == timedelta(seconds=3)
    assert isinstance(open_producer("tls://127.0.0.1:4222", "a.b"), JetStreamProducer)


def test_unknown_url_option_names_the_valid_ones() -> None:
    with pytest.raises(oncely.ConfigurationError, match=r"ack_wait.*max_deliver"):
        open_transport("nats://127.0.0.1:4222?prefetch=3", "a.b", group="g")
    with pytest.raises(oncely.ConfigurationError, match="duplicate_window"):
        open_producer("nats://127.0.0.1:4222?max_deliver=3", "a.b")


def test_dead_letter_subject_inside_the_source_is_refused() -> None:
    with pytest.raises(oncely.ConfigurationError, match="wildcard"):
        JetStream(NATS_URL, "orders.*", group="g")
    with pytest.raises(oncely.ConfigurationError, match="consumed again"):
        JetStream(NATS_URL, "orders.>", group="g", dead_letter="orders.dead")
    JetStream(NATS_URL, "orders.*", group="g", dead_letter="dead.orders")
