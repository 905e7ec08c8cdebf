"""Redis Streams end to end, against a real Redis: a stream read by a consumer group, a
dead-letter stream beside it. The behaviours every broker shares are
:class:`~tests.brokers.suite.BrokerSuite`'s; here is how the suite reaches Redis Streams, and
what only it has: the URL options, the entry layout, an entry taken over by ``XAUTOCLAIM``,
consumers killed with SIGKILL pruned by housekeeping, and Redis killed and restarted mid-run
(on a redis-server of the test's own, append-only file on, fsync always, on a free port: the
shared server on 6379 is never touched).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
import redis

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
from oncely.brokers.redis_streams import RedisStreams, RedisStreamsProducer
from oncely.brokers.redis_streams._delivery import RedisStreamsDelivery
from tests.brokers.common import free_port, publish_until_confirmed, running, unique, wait_until
from tests.brokers.foreign import stream_fields, xadd_raw
from tests.brokers.suite import MS, SECOND, BrokerSuite, DeadCopy, Watched, body, fetch_one
from tests.services import REDIS_URL, require

pytestmark = pytest.mark.services

GROUP = BrokerSuite.group


def group_state(client: redis.Redis, stream: str) -> tuple[int, int | None] | None:
    """(pending entries, entries not yet delivered to the group); None before the group."""
    if not client.exists(stream):
        return None
    for info in client.xinfo_groups(stream):
        if info["name"] == GROUP.encode():
            return int(info["pending"]), info["lag"]
    return None


def settled_on(client: redis.Redis, stream: str) -> bool:
    """Nothing pending, nothing unread: every entry was delivered and acknowledged."""
    return group_state(client, stream) == (0, 0) and client.xpending(stream, GROUP)["pending"] == 0


class TestRedisStreams(BrokerSuite):
    url = REDIS_URL
    producer_class = RedisStreamsProducer
    shared_url_options = "timeout=5&connect_timeout=5"
    consumer_url_options = "consumer=c-1&claim_every=5&delivery_limit=9"
    producer_url_options = "maxlen=1000"

    # ------------------------------------------------------------------ the suite's interface

    def require(self) -> None:
        require("Redis", REDIS_URL, 6379)

    def new_source(self) -> str:
        return unique("rs")

    def transport(self, *, url: str | None = None, **options: Any) -> RedisStreams:
        options.setdefault("claim_every", 100 * MS)
        made = RedisStreams(url or self.url, self.source, group=self.group, **options)
        return self.closed_after(made)

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        # An idle entry is taken over at the next claim round: ack wait 30 s + 100 ms.
        return BrokerLimits(ack_wait=timedelta(seconds=30, milliseconds=100))

    async def publish_raw_without_id(self, payload: bytes) -> None:
        xadd_raw(self.source, [stream_fields(payload, content_type=b"application/json")])

    async def test_r10_a_handler_raising_cancelled_error_is_a_failure(self) -> None:
        await self.check_a_handler_raising_cancelled_error_is_a_failure()

    async def delete_source(self) -> None:
        self.admin.delete(self.source)  # its consumer group goes with it

    async def dead_letters(self) -> list[DeadCopy]:
        copies = []
        for _id, raw in self.admin.xrange(f"{self.source}.dead"):
            fields = {k.decode(): v for k, v in raw.items()}
            text = {k: v.decode("utf-8", "replace") for k, v in fields.items()}
            copies.append(
                DeadCopy(
                    message_id=text.pop("message_id", None),
                    body=fields["body"],
                    content_type=text.pop("content_type", None),
                    headers={k: v for k, v in text.items() if k != "body"},
                )
            )
        return copies

    async def unsettled(self) -> int:
        pending, lag = group_state(self.admin, self.source) or (0, 0)
        assert lag is not None
        return pending + lag

    async def settled(self) -> bool:
        return settled_on(self.admin, self.source)

    async def consumers_reading(self) -> int:
        return len(self.consumers())

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        # Given back, an entry stays pending and comes again as itself (XAUTOCLAIM).
        assert again.describe()["entry_id"] == first.describe()["entry_id"]
        assert again.describe()["stream"] == self.source

    async def test_r8_the_copies_held_while_their_key_is_held_elsewhere_are_bounded(
        self,
    ) -> None:
        """Many copies of one key come while another worker holds it (a two-minute lease):
        the consumer holds and watches at most as many at once as it reads ahead
        (``max(concurrency, batch)``); the rest are given back after the wait, as before.
        Redis Streams hands out new entries whatever a consumer holds pending: without a
        bound, every copy read was held, each a task reading the store every 1.5 s and
        extending its entry, without end as copies came in (R8)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "hot")
        copies = 12
        for _ in range(copies):
            await self.publish("hot")
        worker = self.consumer(self.apply, inbox=inbox, concurrency=2)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["in_flight"] >= copies, what="every copy in_flight"
            )
            # Watches, and at most one task per slot reading or settling a copy.
            assert len(worker._tasks) <= 2 + 2, len(worker._tasks)
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
        assert self.ledger.counts() == {}

    async def test_r8_a_give_back_cut_short_by_the_grace_is_not_made_twice(self) -> None:
        """A held ``in_flight`` copy (its key held under a two-minute lease) is given back
        as the consumer stops, and that give-back is still being awaited when the shutdown
        grace runs out: the cancel does not give the copy back a second time (on RabbitMQ a
        second nack of one delivery tag closes the channel, giving back every message on
        it). The give-back here does its work on Redis, then waits until it is cancelled
        (R8)."""
        (inbox,) = self.inboxes("two_phase", 1)
        await self._claimed_by_hand(inbox, "settling")
        watched = SlowGiveBacks(self.transport())
        worker = self.consumer(
            self.apply, inbox=inbox, transport=watched, shutdown_grace=timedelta(milliseconds=200)
        )
        await self.publish("settling")
        task = asyncio.create_task(worker.run())
        try:
            await wait_until(lambda: worker.counts["in_flight"] == 1, what="the copy in_flight")
            worker.stop()
            await wait_until(task.done, timeout=timedelta(seconds=30), what="the stop")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
        assert watched.give_backs == {"settling": 1}, watched.give_backs
        assert self.ledger.counts() == {}

    async def test_r8_a_stop_is_not_held_up_by_a_store_that_does_not_answer(self) -> None:
        """A held ``in_flight`` copy's watch reads its key's record from a store that never
        answers (a hung connection): a stop gives the copy back at once all the same,
        whatever the ``shutdown_grace`` (ten minutes here), and the next consumer gets it.
        Before, the stop waited for the read, up to the whole grace (R8)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "hung")
        hung = HungReads(inbox.store)
        reading = oncely.AsyncInbox(
            cast(Any, hung), consumer=self.group, lease=oncely.Lease(duration=SECOND)
        )
        first = self.consumer(self.apply, inbox=reading, shutdown_grace=timedelta(minutes=10))
        await self.publish("hung")
        task = asyncio.create_task(first.run())
        try:
            await wait_until(lambda: hung.reads > 0, what="the watch reading the record")
            first.stop()
            await wait_until(task.done, timeout=timedelta(seconds=30), what="the stop")
        finally:
            first.stop()
            await asyncio.wait_for(task, 60)
        assert set(first.counts) == {"in_flight"}, first.counts
        second = self.consumer(self.apply, inbox=inbox)
        async with running(second):
            await wait_until(lambda: second.counts["in_flight"] >= 1, what="the copy again")
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
            await wait_until(
                lambda: second.counts["duplicate"] == 1,
                timeout=timedelta(seconds=30),
                what="the copy acknowledged as a duplicate by the next consumer",
            )
        assert self.ledger.counts() == {}
        await self.assert_settled()

    # ------------------------------------------------------------------ Redis's own state

    @cached_property
    def admin(self) -> redis.Redis:
        client = redis.Redis.from_url(REDIS_URL)
        self.after(lambda: asyncio.to_thread(client.close))
        return client

    def consumers(self, client: redis.Redis | None = None) -> dict[str, tuple[int, int]]:
        """Each consumer of the group: (pending entries, idle milliseconds)."""
        client = client or self.admin
        if group_state(client, self.source) is None:
            return {}
        return {
            c["name"].decode(): (int(c["pending"]), int(c["idle"]))
            for c in client.xinfo_consumers(self.source, GROUP)
        }

    def pending(self) -> list[tuple[bytes, int]]:
        """(consumer, times delivered) of each pending entry."""
        found = self.admin.xpending_range(self.source, GROUP, "-", "+", 10)
        return [(p["consumer"], p["times_delivered"]) for p in found]

    # ------------------------------------------------------------------ the entry layout

    async def test_r4_entry_layout_keys_never_come_from_the_entry_id(self) -> None:
        """The headers are fields of their own, and a field a header would overwrite is
        refused; a producer retry is a new entry with a new entry id, the id a transport
        field only; closing a consumer that holds nothing leaves the group."""
        producer = self.producer()
        with pytest.raises(oncely.ConfigurationError, match="collides"):
            await producer.publish(b"{}", message_id="m", headers={"body": "x"})
        ce = cloudevent_headers(source="/orders", event_type="order.paid", event_id="e-1")
        sent = {**ce, "tenant": "t1"}
        for _retry in range(2):
            await producer.publish(body("m-1"), message_id="m-1", headers=sent)
        reader = self.transport()
        await reader.open(8)
        first, second = await reader.fetch(8, timedelta(seconds=1))
        for delivery in (first, second):
            assert delivery.envelope.headers == sent
            assert delivery.envelope.message_id == "m-1"
        assert first.envelope.transport["entry_id"] != second.envelope.transport["entry_id"]
        assert group_state(self.admin, self.source) == (2, 0)
        await first.ack()
        await second.ack()
        await reader.close()
        await self.assert_settled()
        assert self.consumers() == {}  # close left the group: it held nothing

    async def test_a_dead_letter_copy_keeps_repeated_fields_in_order(self) -> None:
        """A stream entry may repeat a field name (``XADD s * a 1 a 2``). redis-py reads a new
        entry (``XREADGROUP``) into a dict, so its dead-letter copy kept one of the repeated
        fields and lost the others; every field now travels, in order, whichever way the
        entry came (read new, or taken over after a retry)."""
        fields = [
            b"body", b"{not json", b"message_id", b"rep-1", b"tag", b"a",
            b"x", b"1", b"tag", b"b", b"tag", b"c", b"x", b"2",
        ]  # fmt: skip
        again = [*fields[:3], b"rep-2", *fields[4:]]
        made = self.transport(ack_wait=timedelta(seconds=1))
        await made.open(2)
        for entry in (fields, again):
            self.admin.execute_command("XADD", self.source, "*", *entry)
        first, retried = await made.fetch(2, timedelta(seconds=1))  # both read new
        why = DeadLetter(outcome="rejected", reason="test", consumer=self.group, deliveries=1)
        await first.dead_letter(why)
        await retried.retry(timedelta(0))
        taken_over = await fetch_one(made)  # XAUTOCLAIM
        assert taken_over.delivery_count == 2
        await taken_over.dead_letter(why)
        reasons = [k.encode() for k in why.headers()]
        copies = self.admin.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1,
                                 f"{self.source}.dead")  # fmt: skip
        assert len(copies) == 2
        for (_id, copy), sent in zip(copies, (fields, again), strict=True):
            assert copy[: len(sent)] == sent
            assert copy[len(sent) :: 2] == reasons
        await self.assert_settled()

    async def test_r4_an_entry_repeating_its_id_with_other_values_is_refused_not_keyed_on_one(
        self,
    ) -> None:
        """``XADD s * body {} message_id a message_id b``: which id is the message's cannot be
        told. Before, the entry was keyed on the last (``b``), silently: another copy keyed
        on ``a`` ran again, or two messages merged into one key. Now it is dead-lettered
        with the reason (R4, R16), and an entry that repeats a field with one value is read."""
        self.admin.execute_command(
            "XADD", self.source, "*",
            "body", json.dumps({"k": "twice"}), "message_id", "a", "message_id", "b",
        )  # fmt: skip
        self.admin.execute_command(
            "XADD", self.source, "*",
            "body", json.dumps({"k": "same"}), "message_id", "s", "message_id", "s",
        )  # fmt: skip
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] == 1 and sum(worker.counts.values()) >= 2,
                what="both entries settled",
            )
        assert self.ledger.counts() == {"same": 1}
        (copy,) = await self.dead_letters()
        assert "'message_id' more than once" in copy.reason
        await self.assert_settled()

    # ------------------------------------------------------------------ XAUTOCLAIM

    async def test_start_new_reads_a_stream_deleted_and_written_again_from_its_start(
        self,
    ) -> None:
        """With ``start="new"`` a group is made at the end of the stream. The stream deleted
        under a running consumer and written again by a producer before the consumer made
        its group again: the group, made at the end, skipped what the producer had written,
        lost without a word. A stream whose every entry is newer than what the consumer read
        is read from its start."""
        worker = self.consumer(self.apply, transport=self.transport(start="new"))
        producer = self.producer()
        async with running(worker) as task:
            await wait_until(lambda: self._reading(1), what="the group made")
            await producer.publish(body("before"), message_id="before")
            await wait_until(lambda: worker.counts["processed"] == 1, what="the first message")
            self.admin.delete(self.source)
            await producer.publish(body("after"), message_id="after")  # before the group
            await wait_until(
                lambda: task.done() or worker.counts["processed"] == 2,
                timeout=timedelta(seconds=20),
                what="the message written after the stream was deleted",
            )
            assert not task.done()
        assert self.ledger.counts() == {"before": 1, "after": 1}
        await self.assert_settled()

    async def test_r10_an_entry_taken_over_is_settled_by_its_new_owner_only(self) -> None:
        """A consumer that lost an entry to XAUTOCLAIM cannot retry or dead-letter it any more;
        the delivery count rises with the takeover; the delivery limit dead-letters it."""
        await self.publish("m-1")
        slow = self.transport(ack_wait=200 * MS, consumer="slow")
        other = self.transport(ack_wait=200 * MS, consumer="other")
        limited = self.transport(ack_wait=200 * MS, consumer="limited", delivery_limit=2)
        for each in (slow, other, limited):
            await each.open(4)
        (held,) = await slow.fetch(4, timedelta(seconds=1))
        again = await fetch_one(other)  # once idle past ack_wait
        assert again.envelope.message_id == "m-1"
        assert again.delivery_count == 2
        assert again.envelope.transport["redelivered"] is True
        await held.retry(timedelta(0))  # no longer ours: left alone
        await held.dead_letter(
            DeadLetter(outcome="rejected", reason="x", consumer="c", deliveries=1)
        )
        assert self.admin.xlen(f"{self.source}.dead") == 0
        assert self.pending() == [(b"other", 2)]
        # The new owner stops settling; the third delivery is over the limit of 2.
        seen: list[Any] = []

        async def limit_reached() -> bool:
            seen.extend(await limited.fetch(4, 50 * MS))
            return self.admin.xlen(f"{self.source}.dead") == 1

        await wait_until(limit_reached, what="the delivery limit to dead-letter the entry")
        assert seen == []
        (copy,) = await self.dead_letters()
        assert copy.message_id == "m-1"
        assert copy.body == body("m-1")
        assert copy.outcome == "rejected"
        assert "over the delivery limit of 2" in copy.reason
        assert copy.deliveries == "3"
        assert copy.consumer == self.group  # no BrokerConsumer named its inbox: the group
        for each in (slow, other, limited):
            await each.close()
        await self.assert_settled()

    async def test_the_delivery_limit_dead_letter_names_the_inbox_consumer(self) -> None:
        """An entry taken over more often than ``delivery_limit`` is dead-lettered by the
        transport while it reads, before any handler. Its copy said ``x-oncely-consumer`` =
        the Redis consumer name of the process (``host-pid-xxxxxx`` by default), where every
        other dead letter names the inbox's consumer; it names the inbox's consumer now."""
        await self.publish("m-1")

        async def failing(payload: dict[str, Any]) -> None:
            raise RuntimeError("always")

        transport = self.transport(ack_wait=200 * MS, consumer="host-7", delivery_limit=2)
        worker = self.consumer(
            failing, transport=transport, inbox=self.inbox_named("ledger-writer"),
            max_deliveries=5,
        )  # fmt: skip
        async with running(worker):
            await wait_until(
                lambda: self.admin.xlen(f"{self.source}.dead") == 1,
                what="the delivery limit to dead-letter the entry",
            )
        assert worker.counts["failed"] == 2
        (copy,) = await self.dead_letters()
        assert "over the delivery limit of 2" in copy.reason
        assert copy.consumer == "ledger-writer"
        await self.assert_settled()

    async def test_consumers_killed_with_sigkill_are_pruned_once_idle_and_empty(self) -> None:
        """Consumers whose process was SIGKILLed stay registered; a transport that opens
        deletes those idle past ``prune_idle_consumers`` that hold nothing, keeps one holding
        an entry until XAUTOCLAIM took the entry over, then deletes it too on a later round."""
        await self.publish("m-1")
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _KILLED_CONSUMERS,
            REDIS_URL,
            self.source,
            GROUP,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 60)
            assert line.strip() == b"1"  # "holder" holds the entry
        finally:
            child.kill()  # SIGKILL: neither consumer leaves the group
            await child.wait()
        threshold = timedelta(seconds=2)
        limit_ms = threshold.total_seconds() * 1000

        def both_idle_past_the_threshold() -> bool:
            found = self.consumers()
            return all(found[name][1] > limit_ms for name in ("gone", "holder"))

        await wait_until(both_idle_past_the_threshold, what="the killed consumers to be idle")
        self.admin.xgroup_createconsumer(self.source, GROUP, "fresh")  # idle for far less
        sweeper = self.transport(
            consumer="sweeper", ack_wait=200 * MS, prune_idle_consumers=threshold
        )
        await sweeper.open(4)
        found = self.consumers()
        assert set(found) == {"holder", "fresh", "sweeper"}  # "gone" was deleted
        assert found["holder"][0] == 1  # kept: it still holds the entry
        assert [owner for owner, _times in self.pending()] == [b"holder"]
        delivery = await fetch_one(sweeper)  # XAUTOCLAIM takes it
        assert delivery.delivery_count == 2
        await delivery.ack()

        async def holder_pruned() -> bool:
            await sweeper.fetch(4, 50 * MS)  # housekeeping runs again while reading
            return "holder" not in self.consumers()

        await wait_until(holder_pruned, what="the emptied holder to be deleted")
        assert "sweeper" in self.consumers()
        await sweeper.close()
        await self.assert_settled()

    # ------------------------------------------------------------------ broker restart

    @pytest.mark.slow
    async def test_f_r1_redis_killed_and_restarted_mid_run(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """SIGKILL to a redis-server of the test's own mid-run, then started again on the same
        append-only file: the same consumer rides it out, the producer retries with the same
        ids (R2), and every message is applied once."""
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        server = _start_redis(port, tmp_path)
        try:
            producer = self.producer(url=url)
            keys = [f"m-{i}" for i in range(40)]
            for key in keys:
                await producer.publish(body(key), message_id=key)

            async def handler(tx: Any, payload: dict[str, str]) -> None:
                await self.apply_in(tx, payload)
                await asyncio.sleep(0.05)

            made = self.transport(url=url, ack_wait=timedelta(seconds=1))
            worker = self.consumer(handler, mode="transactional", transport=made, concurrency=2)
            async with running(worker) as task:
                await wait_until(lambda: len(self.ledger.counts()) >= 8, what="some processed")
                server.send_signal(signal.SIGKILL)
                server.wait()
                done_at_kill = len(self.ledger.counts())
                await asyncio.sleep(0.5)  # the consumer meets the dead connection
                server = _start_redis(port, tmp_path)
                later = [f"m-{i}" for i in range(40, 50)]
                for key in later:
                    await publish_until_confirmed(producer, body(key), key)
                keys += later
                private = redis.Redis(port=port)
                try:
                    await wait_until(
                        lambda: (
                            len(self.ledger.counts()) == 50 and settled_on(private, self.source)
                        ),
                        what="every message after the restart",
                    )
                finally:
                    private.close()
                assert not task.done()  # the same consumer rode the restart out
            assert done_at_kill < 40  # the kill really was mid-run
            assert any("unavailable" in r.getMessage() for r in caplog.records)  # and noticed
            assert self.ledger.counts() == dict.fromkeys(keys, 1)
            assert worker.counts["processed"] == 50
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGKILL)
            server.wait()


# A process with two consumers of the group: "gone" reads nothing, "holder" reads one entry and
# never settles it. It prints once both are registered and is then killed with SIGKILL.
_KILLED_CONSUMERS = """
import asyncio, sys
from datetime import timedelta
from oncely.brokers.redis_streams import RedisStreams

async def main(url, stream, group):
    gone = RedisStreams(url, stream, group=group, consumer="gone", prune_idle_consumers=None)
    holder = RedisStreams(url, stream, group=group, consumer="holder", prune_idle_consumers=None)
    await gone.open(1)
    await holder.open(1)
    print(len(await holder.fetch(1, timedelta(seconds=10))), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


def _start_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory)),
            *("--logfile", str(directory / "redis.log")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                if client.ping():
                    return server
            except redis.exceptions.RedisError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    finally:
        client.close()


# ---------------------------------------------------------------------- configuration


def test_registry_urls_and_options() -> None:
    url = "redis://127.0.0.1:6379/0?ack_wait=2&consumer=c-1&delivery_limit=9&start=new"
    opened = open_transport(url, "orders", group=GROUP)
    assert isinstance(opened, RedisStreams)
    assert opened.ack_wait == timedelta(seconds=2)
    assert opened.extend_every == timedelta(seconds=2) / 3
    assert (opened.consumer, opened.delivery_limit) == ("c-1", 9)
    assert opened.dead_letter_stream == "orders.dead"
    keyword = open_transport(url, "orders", group=GROUP, ack_wait=timedelta(seconds=5))
    assert keyword.ack_wait == timedelta(seconds=5)  # type: ignore[attr-defined]
    first = RedisStreams(REDIS_URL, "orders", group=GROUP)
    assert first.consumer != RedisStreams(REDIS_URL, "orders", group=GROUP).consumer
    assert first.consumer.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    with pytest.raises(oncely.ConfigurationError, match=r"'prefetch'.*known: consumer, ack_wait"):
        open_transport("redis://127.0.0.1/0?prefetch=3", "orders", group=GROUP)
    with pytest.raises(oncely.ConfigurationError, match="R4"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, message_id_field="entry_id")
    with pytest.raises(oncely.ConfigurationError, match="dead-letter"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, dead_letter="orders")
    assert isinstance(
        open_producer("redis://127.0.0.1:6379/0?maxlen=100", "orders"), RedisStreamsProducer
    )
    # A consumer's option is named as the consumer's, with the producer's own.
    said = r"'ack_wait': a consumer option, .* \(the producer's options: maxlen"
    with pytest.raises(oncely.ConfigurationError, match=said):
        open_producer("redis://127.0.0.1:6379/0?ack_wait=1", "orders")
    assert first.prune_idle_consumers == timedelta(hours=1)
    never = open_transport(f"{REDIS_URL}?prune_idle_consumers=0", "orders", group=GROUP)
    assert never.prune_idle_consumers is None  # type: ignore[attr-defined]
    with pytest.raises(oncely.ConfigurationError, match="prune_idle_consumers"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, prune_idle_consumers=timedelta(0))


class SlowGiveBacks(Watched):
    """A transport whose deliveries' first give-back does its work on Redis, then waits
    until it is cancelled (a broker slow to confirm it); the give-backs counted by message
    id."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.give_backs: Counter[str | None] = Counter()

    def _saw(self, found: list[Delivery]) -> list[Delivery]:
        for delivery in found:
            assert isinstance(delivery, RedisStreamsDelivery)
            delivery.__class__ = _SlowGiveBack
        _SlowGiveBack.noted = self.give_backs
        return super()._saw(found)


class _SlowGiveBack(RedisStreamsDelivery):
    __slots__ = ()
    noted: ClassVar[Counter[str | None]]

    async def retry(self, delay: timedelta) -> None:
        await super().retry(delay)
        self.noted[self.envelope.message_id] += 1
        if self.noted[self.envelope.message_id] == 1:
            await asyncio.Event().wait()  # until cancelled


class HungReads:
    """A store whose ``get`` never answers (a hung connection); everything else is the real
    store's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, consumer: str, key: str) -> Any:
        self.reads += 1
        await asyncio.Event().wait()  # until cancelled
