"""Kafka end to end, on Tansu (a Kafka-protocol broker, started by the tests: see
``kafka_broker.py``), not on Apache Kafka itself: a topic of four partitions read by a consumer
group, a dead-letter topic beside it. The behaviours every broker shares are
:class:`~tests.brokers.suite.BrokerSuite`'s; here is how the suite reaches Kafka, and what only
Kafka has: one record per partition at a time, commits that never pass an unfinished record,
and the producer's idempotence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, ClassVar

import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

import oncely
from oncely.brokers import (
    BrokerConsumer,
    BrokerLimits,
    Delivery,
    InboxProcessor,
    Transport,
    open_producer,
    open_transport,
)
from oncely.brokers.kafka import Kafka, KafkaProducer, Tombstone
from oncely.brokers.kafka._producer import topic_id
from oncely.brokers.kafka._records import Cluster
from oncely.brokers.kafka._transport import _DONE as DONE
from oncely.brokers.kafka._transport import _RUNNING as RUNNING
from oncely.brokers.kafka._transport import RETIRED_OFFSET, KafkaDelivery
from oncely.errors import BrokerError
from tests.brokers.common import Proxy, free_port, running, unique, wait_until
from tests.brokers.kafka_broker import (
    create_topic,
    delete_topics,
    kafka_url,
    produce_raw,
    start_tansu,
    stop_tansu,
    tansu_binary,
)
from tests.brokers.suite import (
    MS,
    SECOND,
    BrokerSuite,
    DeadCopy,
    Watched,
    body,
    fetch_one,
    total,
)
from tests.services import POSTGRES_DSN

pytestmark = pytest.mark.services

PARTITIONS = 4
SESSION = timedelta(seconds=6)
"""Tansu holds a group join for half the session timeout: short sessions keep tests short."""
GRACE = timedelta(seconds=5)
RECORDS = 400


class TestKafka(BrokerSuite):
    producer_class = KafkaProducer
    shared_url_options = "timeout=30&connect_timeout=10&client_id=oncely-tests"
    consumer_url_options = "session_timeout=6&partitions=2&revoke_grace=5"
    producer_url_options = "idempotence=true&linger=0.01"
    consumer_makes_its_source_again = False  # its partitions and settings are the operator's

    @property  # type: ignore[override]
    def url(self) -> str:  # started on first use; a test's own broker while it has one
        return self._private_url or kafka_url()

    # ------------------------------------------------------------------ the suite's interface

    def require(self) -> None:
        kafka_url()

    def new_source(self) -> str:
        # A group of its own per test: a Kafka group spans topics, and a member of an earlier
        # test's group that has not left yet would hold up this test's rebalances.
        self.group = unique("billing")  # type: ignore[misc]
        self._made: list[Kafka] = []
        name = unique("kt")
        create_topic(name, PARTITIONS)
        return name

    def transport(
        self, *, url: str | None = None, group: str | None = None, **options: Any
    ) -> Kafka:
        options.pop("ack_wait", None)  # Kafka has no per-record ack wait
        options.setdefault("session_timeout", SESSION)
        options.setdefault("revoke_grace", GRACE)
        made = Kafka(url or self.url, self.source, group=group or self.group, **options)
        self._made.append(made)
        return self.closed_after(made)

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        return BrokerLimits(ack_wait=SESSION + GRACE)

    async def publish_raw_without_id(self, payload: bytes) -> None:
        producer = await self._raw_producer()
        await producer.send(self.source, payload, [("content-type", b"application/json")], key=None)

    async def _raw_producer(self) -> KafkaProducer:
        made = KafkaProducer(self.url, self.source)
        self.after(made.close)
        return made

    async def _read_all(self, topic: str) -> list[Any]:
        consumer = AIOKafkaConsumer(bootstrap_servers=self._servers, enable_auto_commit=False)
        await consumer.start()
        try:
            parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            if not parts:
                await consumer.force_metadata_update()  # type: ignore[no-untyped-call]
                parts = [
                    TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()
                ]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            ends = await consumer.end_offsets(parts)
            records: list[Any] = []
            for _ in range(50):
                positions = [await consumer.position(tp) for tp in parts]
                if all(at >= ends[tp] for at, tp in zip(positions, parts, strict=True)):
                    break
                batch = await consumer.getmany(timeout_ms=200)
                for got in batch.values():
                    records.extend(got)
            return records
        finally:
            await consumer.stop()

    @property
    def _servers(self) -> str:
        return self.url.removeprefix("kafka://")

    async def dead_letters(self) -> list[DeadCopy]:
        copies = []
        for record in await self._read_all(f"{self.source}.dead"):
            headers = {
                name: (value or b"").decode("utf-8", "replace") for name, value in record.headers
            }
            copies.append(
                DeadCopy(
                    message_id=headers.pop("message-id", None),
                    body=record.value,
                    content_type=headers.pop("content-type", None),
                    headers=headers,
                )
            )
        return copies

    async def _lag(self) -> int:
        """Records of the source past the group's committed offsets, counted by reading
        them: Tansu's end offset is the last produced batch's first offset plus one, short by
        the rest of a batch (150 records published at once end at 1 per partition), so ends
        minus commits can go negative or hide records."""
        group = AIOKafkaConsumer(
            bootstrap_servers=self._servers, group_id=self.group, enable_auto_commit=False
        )
        reader = AIOKafkaConsumer(
            bootstrap_servers=self._servers, enable_auto_commit=False, fetch_max_wait_ms=100
        )
        await group.start()
        await reader.start()
        try:
            parts = [TopicPartition(self.source, p) for p in range(PARTITIONS)]
            committed = {tp: await group.committed(tp) or 0 for tp in parts}
            reader.assign(parts)
            for tp, offset in committed.items():
                reader.seek(tp, offset)
            lag = 0
            while batch := await reader.getmany(timeout_ms=300):
                lag += sum(len(records) for records in batch.values())
            return lag
        finally:
            await reader.stop()
            await group.stop()

    async def unsettled(self) -> int | None:
        return await self._lag()

    async def consumers_reading(self) -> int:
        """This test's transports that own partitions now (with Tansu a group can report
        itself stable while a member's assignment has not reached it yet)."""
        return sum(1 for made in self._made if made.assignment)

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        # Given back, a record comes again as itself: same partition, same offset.
        assert again.describe()["partition"] == first.describe()["partition"]
        assert again.describe()["offset"] == first.describe()["offset"]
        assert again.describe()["topic"] == self.source

    async def remove(self) -> None:
        with contextlib.suppress(Exception):
            delete_topics(self.source, f"{self.source}.dead")

    async def delete_source(self) -> None:
        await asyncio.to_thread(delete_topics, self.source)

    async def make_source_again(self) -> None:
        await asyncio.to_thread(create_topic, self.source, PARTITIONS, self.url)

    async def source_gone_noticed(self, watched: Watched) -> bool:
        return any(made._topic_gone for made in self._made)

    # ------------------------------------------------------------------ connection cuts

    _private_url: str | None = None
    _private_proxy: Proxy | None = None

    @contextlib.asynccontextmanager
    async def _behind_a_proxy(self) -> AsyncIterator[Proxy]:
        """A Tansu of this test's own whose metadata sends every client to a proxy in front
        of it: a Kafka client reaches the bootstrap address, then the broker the metadata
        names, so only a broker that advertises the proxy's port has all its connections
        (group coordinator and fetches included) pass through the proxy. For the block, the
        test's URL is that broker (its clients go through the proxy) and its topic lives
        there."""
        binary = tansu_binary()
        assert binary is not None, "kafka_url() ran: the binary is there"
        port, advertised = free_port(), free_port()
        process = await asyncio.to_thread(start_tansu, binary, port, advertised)
        try:
            async with Proxy(f"kafka://127.0.0.1:{port}", port=advertised) as proxy:
                self._private_url = f"kafka://127.0.0.1:{port}"
                self._private_proxy = proxy
                try:
                    await asyncio.to_thread(create_topic, self.source, PARTITIONS, self.url)
                    yield proxy
                finally:
                    self._private_url = self._private_proxy = None
        finally:
            await asyncio.to_thread(stop_tansu, process)

    @contextlib.asynccontextmanager
    async def _own_broker(self) -> AsyncIterator[subprocess.Popen[bytes]]:
        """A Tansu of this test's own, to kill: for the block, the test's URL is that broker
        and its topic lives there."""
        binary = tansu_binary()
        assert binary is not None, "kafka_url() ran: the binary is there"
        port = free_port()
        process = await asyncio.to_thread(start_tansu, binary, port, port)
        try:
            self._private_url = f"kafka://127.0.0.1:{port}"
            try:
                await asyncio.to_thread(create_topic, self.source, PARTITIONS, self.url)
                yield process
            finally:
                self._private_url = None
        finally:
            await asyncio.to_thread(stop_tansu, process)

    def proxy(self) -> contextlib.AbstractAsyncContextManager[Proxy]:
        proxy = self._private_proxy
        assert proxy is not None, "run inside _behind_a_proxy()"

        @contextlib.asynccontextmanager
        async def running() -> AsyncIterator[Proxy]:
            yield proxy
            proxy.refusing = False

        return running()

    async def test_settling_on_a_lost_connection_raises_broker_unavailable_and_it_comes_back(
        self,
    ) -> None:
        """Kafka's ack is this member's own (the offset commit carries it to the broker): the
        connection cut with a record held, the ack still lands locally, and the fetch that
        must commit it raises BrokerUnavailable within the transport's timeout (never a raw
        client error). Once the broker can be reached again the commit goes through: the
        record is finished, not lost and not handed out again (should the outage outlast the
        session, the group hands it out once more, and it is finished then)."""
        async with self._behind_a_proxy() as proxy:
            made = self.transport(timeout=2 * SECOND)
            await made.open(1)
            assert await made.fetch(1, 300 * MS) == []
            await self.publish("x")
            held = await fetch_one(made)
            assert held.envelope.message_id == "x" and held.delivery_count == 1
            proxy.refusing = True
            assert proxy.cut() >= 1
            await held.ack()
            with pytest.raises(oncely.BrokerUnavailable, match="commit"):
                for _ in range(100):
                    await made.fetch(1, 100 * MS)
            proxy.refusing = False

            async def committed() -> bool:
                with contextlib.suppress(oncely.BrokerUnavailable):
                    for again in await made.fetch(1, 100 * MS):
                        assert again.envelope.message_id == "x"
                        await again.ack()
                return await self._lag() == 0

            await wait_until(committed, what="the commit after the outage")
            await made.close()
            await self.assert_settled()

    async def test_r8_r10_connection_cut_under_a_slow_handler_applies_once(self) -> None:
        async with self._behind_a_proxy():
            await super().test_r8_r10_connection_cut_under_a_slow_handler_applies_once()

    # ------------------------------------------------------------------ Kafka's own

    async def test_a_record_after_an_unfinished_one_is_never_committed(self) -> None:
        """One partition of four records: while the first is unfinished (handed out, then
        given back and handed out again) nothing after it is handed out and nothing is
        committed; once it is finished, the rest follow in order and the commit is the end
        of the run."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        for n in range(4):
            await producer.publish(body(f"r{n}"), message_id=f"r{n}")
        transport = Kafka(self.url, name, group=self.group, session_timeout=SESSION)
        self.closed_after(transport)
        await transport.open(4)
        first = await fetch_one(transport)
        assert first.envelope.message_id == "r0"
        assert await transport.fetch(4, 300 * MS) == []  # r1..r3 wait behind r0
        await first.retry(timedelta(0))
        again = await fetch_one(transport)
        assert again.envelope.message_id == "r0" and again.delivery_count == 2
        assert await self._committed(name) is None
        await again.ack()
        rest = []
        while len(rest) < 3:
            got = await fetch_one(transport)
            rest.append(got.envelope.message_id)
            await got.ack()
        assert rest == ["r1", "r2", "r3"]
        assert await transport.fetch(1, 100 * MS) == []  # commits what is finished
        assert await self._committed(name) == 4

    async def test_r7_a_stop_while_the_broker_is_gone_returns_cleanly(self) -> None:
        """The broker dies under a running consumer (SIGKILL to this test's own Tansu), then
        the consumer is asked to stop (SIGTERM during an outage): ``run()`` returns, nothing
        raised. aiokafka's ``stop()`` can end in a ``CancelledError`` of its own while the
        broker is away; the transport's close logs such a failure at WARNING and lets the
        client go (what was not committed is read again by the group), while a cancellation
        of the closing task itself still propagates."""
        async with self._own_broker() as broker:
            keys = [f"k{n}" for n in range(8)]
            for key in keys:
                await self.publish(key)
            # A short timeout: the commits the outage holds up give up sooner.
            worker = self.consumer(self.apply, transport=self.transport(timeout=2 * SECOND))
            task = asyncio.create_task(worker.run())
            try:
                await wait_until(lambda: worker.counts["processed"] == 8, what="all eight")
                broker.kill()  # SIGKILL
                await asyncio.to_thread(broker.wait)
                await asyncio.sleep(1)  # the client meets the outage (fetches, heartbeats)
                worker.stop()
                await asyncio.wait_for(task, 60)  # returns; raises nothing
            finally:
                worker.stop()
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
        assert worker.counts == Counter({"processed": 8})
        assert self.ledger.counts() == dict.fromkeys(keys, 1)

    async def test_r7_close_swallows_the_clients_own_cancellation_never_its_own(self) -> None:
        """What tells the two apart: a ``CancelledError`` raised by the client's stop() (the
        closing task is not being cancelled) is logged and swallowed; a cancellation of the
        closing task itself propagates."""
        made = self.transport()

        async def clients_own() -> None:
            raise asyncio.CancelledError  # as aiokafka's fetcher re-raises its fetch task's

        assert await made._quietly("stop the client", clients_own()) is False
        started = asyncio.Event()

        async def slow() -> None:
            started.set()
            await asyncio.sleep(60)

        closing = asyncio.create_task(made._quietly("stop the client", slow()))
        await started.wait()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    # ------------------------------------------------------------------ offsets in the database

    def _keeping(
        self,
        inbox: oncely.AsyncInbox,
        group: str,
        *,
        topic: str | None = None,
        handler: Any = None,
        **settings: Any,
    ) -> BrokerConsumer:
        """A transactional consumer that keeps its offsets in the inbox's database, reading
        the suite's topic or ``topic``, running ``handler`` (default: the ledger's insert)."""
        transport = (
            self.transport(group=group)
            if topic is None
            else self.closed_after(Kafka(self.url, topic, group=group, session_timeout=SESSION))
        )
        return BrokerConsumer(
            transport,
            inbox,
            handler if handler is not None else self.apply_in,
            mode="transactional",
            store_offsets=True,
            settings=self.settings(**settings),
        )

    async def _stored(self, store: oncely.AsyncPostgresStore, topic: str) -> dict[int, int]:
        """The offsets ``store`` keeps for the suite's group on ``topic`` as it is now (under
        its name and id, as the transport keeps them)."""
        cluster, _ = Cluster.from_url(self.url)
        found = await asyncio.to_thread(topic_id, cluster, topic, timedelta(seconds=10))
        assert found is not None  # Tansu gives topics ids
        return await store.offsets(self.group, f"{topic}@{found}")

    async def _kept_through(self, inbox: oncely.AsyncInbox, prefix: str, n: int) -> list[str]:
        """``n`` records published and applied by a consumer of the suite's group that keeps
        its offsets in the database; their keys."""
        keys = [f"{prefix}{i}" for i in range(n)]
        for key in keys:
            await self.publish(key)
        worker = self._keeping(inbox, self.group)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == n, what=f"the first {n}")
        return keys

    async def test_offsets_in_the_transaction_outlive_the_groups_commits_and_the_markers(
        self,
    ) -> None:
        """``store_offsets``: each record's next offset is written with its ledger row. A group
        that lost its commits (here: a group that never had any) with an inbox that no longer
        holds the markers (forgotten, as after retention) starts each partition from the
        stored offset: nothing applied twice, later records applied once. The same group
        change without stored offsets applies every earlier record again (what the stored
        offsets prevent)."""
        (inbox,) = self.inboxes("transactional", 1)
        first = await self._kept_through(inbox, "o", 40)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)
        ends: Counter[int] = Counter()
        for record in await self._read_all(self.source):
            ends[record.partition] = max(ends[record.partition], record.offset + 1)
        assert await self._stored(store, self.source) == dict(ends)
        for key in first:  # the markers are gone: only the stored offsets remember
            assert await inbox.forget(key)

        later = [f"p{n}" for n in range(8)]
        for key in later:
            await self.publish(key)
        fresh = self._keeping(inbox, unique("lost-commits"))
        async with running(fresh):
            await wait_until(lambda: fresh.counts["processed"] == 8, what="the 8 later ones")
        assert sum(fresh.counts.values()) == 8  # the first 40 were never read again
        assert self.ledger.counts() == dict.fromkeys(first + later, 1)

        control = BrokerConsumer(
            self.transport(group=unique("no-stored-offsets")),
            inbox,
            self.apply_in,
            mode="transactional",
            settings=self.settings(),
        )
        async with running(control):
            await wait_until(lambda: sum(control.counts.values()) == 48, what="all 48 again")
        assert control.counts["processed"] == 40 and control.counts["duplicate"] == 8
        assert self.ledger.counts() == {**dict.fromkeys(first, 2), **dict.fromkeys(later, 1)}

    async def test_r7_offsets_kept_in_dynamodb_with_the_writes_outlive_the_commits_and_markers(
        self,
    ) -> None:
        """``store_offsets`` on the DynamoDB store (moto's server): each record's ledger item,
        marker and next offset in one TransactWriteItems; a group that lost its commits, on an
        inbox without the markers, starts from the stored offsets and applies nothing twice."""
        from tests.backends import Scope
        from tests.backends.dynamodb import SyncDynamoDBLedger, drop_table, endpoint

        table = unique("oncely_kafka_inbox")
        scope = Scope(tmp_path=None, unique=unique("k"))  # type: ignore[arg-type]
        ledger = SyncDynamoDBLedger(scope, None)

        async def clean() -> None:
            for name in (table, ledger.table):
                await asyncio.to_thread(drop_table, name)

        self.after(clean)
        store = oncely.open_async(f"dynamodb://{endpoint()}/{table}")
        self.after(store.aclose)
        inbox = oncely.AsyncInbox(store, consumer=self.group)

        async def apply(tx: Any, payload: dict[str, Any]) -> None:
            ledger.put(tx, payload["k"], 1)

        first = [f"d{i}" for i in range(24)]
        for key in first:
            await self.publish(key)
        worker = self._keeping(inbox, self.group, handler=apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 24, what="the first 24")
        ends: Counter[int] = Counter()
        for record in await self._read_all(self.source):
            ends[record.partition] = max(ends[record.partition], record.offset + 1)
        assert await self._stored(store, self.source) == dict(ends)  # type: ignore[arg-type]
        for key in first:  # the markers are gone: only the stored offsets remember
            assert await inbox.forget(key)
        later = [f"e{n}" for n in range(6)]
        for key in later:
            await self.publish(key)
        fresh = self._keeping(inbox, unique("lost-commits"), handler=apply)
        async with running(fresh):
            await wait_until(lambda: fresh.counts["processed"] == 6, what="the 6 later ones")
        assert sum(fresh.counts.values()) == 6  # the first 24 were never read again
        counts = await asyncio.to_thread(lambda: {k: ledger.count(k) for k in first + later})
        assert counts == dict.fromkeys(first + later, 1)

    async def test_nothing_is_read_before_the_stored_offsets_answer(self) -> None:
        """The stored offsets are read when the group assigns the partitions; the client
        starts fetching from the group's commit meanwhile. Before, a database slow to answer
        (here 2 s) let those records run, the forgotten ones applied a second time; now the
        partitions wait for their start, and only the later records run."""
        (inbox,) = self.inboxes("transactional", 1)
        first = await self._kept_through(inbox, "s", 20)
        for key in first:
            assert await inbox.forget(key)
        later = [f"t{n}" for n in range(4)]
        for key in later:
            await self.publish(key)

        class SlowDatabase(Kafka):
            def start_from(self, read: Any, save: Any = None) -> None:
                async def slowly(topic: str) -> Any:
                    await asyncio.sleep(2.0)
                    return await read(topic)

                super().start_from(slowly, save)

        transport = SlowDatabase(
            self.url, self.source, group=unique("lost"), session_timeout=SESSION
        )
        self.closed_after(transport)
        fresh = BrokerConsumer(
            transport,
            inbox,
            self.apply_in,
            mode="transactional",
            store_offsets=True,
            settings=self.settings(),
        )
        async with running(fresh):
            await wait_until(lambda: fresh.counts["processed"] == 4, what="the 4 later ones")
        assert sum(fresh.counts.values()) == 4
        assert self.ledger.counts() == dict.fromkeys(first + later, 1)

    def _dead_letters_held_up(self, name: str) -> tuple[Kafka, asyncio.Event]:
        """A transport of ``name`` whose dead-letter copies wait until the event is set."""
        copying = asyncio.Event()

        class HeldUp(Kafka):
            async def _copy_to_dead_letter(self, held: Any, why: Any) -> None:
                await copying.wait()
                await super()._copy_to_dead_letter(held, why)

        return HeldUp(self.url, name, group=self.group, session_timeout=SESSION), copying

    def _storing_offsets(self, transport: Kafka, inbox: oncely.AsyncInbox) -> BrokerConsumer:
        """A transactional worker on ``transport`` keeping its offsets with the marker."""
        self.closed_after(transport)
        return BrokerConsumer(
            transport,
            inbox,
            self.apply_in,
            mode="transactional",
            store_offsets=True,
            settings=self.settings(),
        )

    async def test_a_stored_offset_never_passes_a_record_whose_dead_letter_is_still_to_come(
        self,
    ) -> None:
        """One partition: r0 processed, r1 undecodable, r2 processed. While r1's dead-letter
        copy is held up (not yet written) the stored offset stays at 1 (past r0 only), so a
        crash before the copy cannot skip r1; once the broker has the copy, the offset past
        r1 and r2 is stored (in a transaction of its own), the broker's commit moves past all
        three, and the next record stores its own."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        await producer.publish(body("r0"), message_id="r0")
        await producer.publish(b"{not json", message_id="r1")
        await producer.publish(body("r2"), message_id="r2")
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)
        transport, copying = self._dead_letters_held_up(name)
        worker = self._storing_offsets(transport, inbox)
        try:
            async with running(worker):
                await wait_until(lambda: worker.counts["rejected"] == 1, what="r1 refused")
                assert await self._stored(store, name) == {0: 1}
                copying.set()
                await wait_until(lambda: worker.counts["processed"] == 2, what="r2")

                async def past_r2() -> bool:
                    return await self._stored(store, name) == {0: 3}

                await wait_until(past_r2, what="the offset past r2 stored")
                await producer.publish(body("r3"), message_id="r3")
                await wait_until(lambda: worker.counts["processed"] == 3, what="r3")
        finally:
            copying.set()
        assert await self._stored(store, name) == {0: 4}
        assert await self._committed(name) == 4
        assert len(await self._read_all(f"{name}.dead")) == 1

    async def test_r13_records_finished_after_a_failed_dead_letter_copy_store_their_offset(
        self,
    ) -> None:
        """One partition: r0 processed, r1 undecodable, r2 processed (its offset not written:
        r1's dead letter was still to come). The first copy of r1 to the dead-letter topic
        fails, so r1 is handed out alone again, copied, and its offset stored; r2, finished
        already, is then passed without running again. Before, r2's offset was never stored:
        the stored offset stayed at 2 while the group's commit went to 3, so a group that
        lost its commits, on an inbox that no longer holds r2's marker (R13: retention),
        applied r2 a second time. Now passing r2 stores its offset too."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        await producer.publish(body("r0"), message_id="r0")
        await producer.publish(b"{not json", message_id="r1")
        await producer.publish(body("r2"), message_id="r2")
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)
        copies = 0

        class FailsOnce(Kafka):
            async def _copy_to_dead_letter(self, held: Any, why: Any) -> None:
                nonlocal copies
                copies += 1
                if copies == 1:
                    raise BrokerError("the dead-letter topic is away")
                await super()._copy_to_dead_letter(held, why)

        transport = FailsOnce(self.url, name, group=self.group, session_timeout=SESSION)
        worker = self._storing_offsets(transport, inbox)
        async with running(worker):

            async def committed_past_r2() -> bool:
                return await self._committed(name) == 3

            await wait_until(committed_past_r2, what="the group's commit past r2")
        assert worker.counts["dead_letter_failed"] == 1 and copies == 2
        assert await self._stored(store, name) == {0: 3}

        for key in ("r0", "r2"):  # the markers are gone: only the stored offsets remember
            assert await inbox.forget(key)
        fresh = self._keeping(inbox, unique("lost-commits"), topic=name)
        await producer.publish(body("r3"), message_id="r3")
        async with running(fresh):
            await wait_until(lambda: fresh.counts["processed"] == 1, what="r3")
        assert fresh.counts == Counter({"processed": 1})
        assert self.ledger.counts() == {"r0": 1, "r2": 1, "r3": 1}

    async def test_r13_a_dead_letter_of_a_deleted_log_never_stores_its_offset_for_the_new(
        self,
    ) -> None:
        """One partition: a0..a4 processed, a5 undecodable, its dead-letter copy held up while
        the topic is deleted and created again under the running member (which finds the new
        id and reads the new log from its start). The copy is then written and a5's offset
        stored. Before, a record's position named the stream the transport had when it was
        stored, not when it was read: a5's offset 6 went under the new log's id, and a
        member of the group started on the new log once it held 8 records began at offset 6,
        its first six records skipped, never processed. Now a5's offset is kept under the old
        log's stream, and every record of the new log is applied."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        for n in range(5):
            await producer.publish(body(f"a{n}"), message_id=f"a{n}")
        await producer.publish(b"{not json", message_id="a5")
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)
        transport, copying = self._dead_letters_held_up(name)
        transport.topic_check_every = timedelta(milliseconds=200)
        worker = self._storing_offsets(transport, inbox)
        try:
            async with running(worker):
                await wait_until(lambda: worker.counts["rejected"] == 1, what="a5 refused")
                old_stream = transport.offsets_stream
                await asyncio.to_thread(delete_topics, name)
                await asyncio.to_thread(create_topic, name, 1, self.url)
                await wait_until(
                    lambda: transport.offsets_stream != old_stream, what="the new log found"
                )
                copying.set()

                async def copied() -> bool:
                    return len(await self._read_all(f"{name}.dead")) == 1

                await wait_until(copied, what="a5's dead letter")
        finally:
            copying.set()
        assert await store.offsets(self.group, old_stream) == {0: 6}
        assert await self._stored(store, name) == {}  # nothing of the new log ran yet

        for n in range(8):
            await producer.publish(body(f"b{n}"), message_id=f"b{n}")
        again = self._keeping(inbox, self.group, topic=name)
        async with running(again):
            await wait_until(lambda: again.counts["processed"] == 8, what="the new log")
        assert self.ledger.counts() == {
            **{f"a{n}": 1 for n in range(5)},
            **{f"b{n}": 1 for n in range(8)},
        }

    async def test_r13_r20_a_dead_letter_stores_its_offset_so_a_new_group_skips_it(
        self,
    ) -> None:
        """``store_offsets`` with dead letters: a reused id with other content (key_conflict,
        R20 step 6), a handler's ``Reject`` and a handler that fails on every delivery are
        dead-lettered, and once each copy is written its next offset is stored. A consumer of
        a new group (its Kafka commits lost) starts from the stored offset: no record is
        dead-lettered a second time, the failing handler is not run again, only the later
        record is read."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        calls: Counter[str] = Counter()

        async def handler(tx: Any, payload: dict[str, Any]) -> None:
            calls[payload["k"]] += 1
            if payload.get("poison"):
                raise oncely.Reject("poison pill: no such account")
            if payload["k"] == "always":
                raise RuntimeError("the gateway is down")
            await self.apply_in(tx, payload)

        await producer.publish(body("pay", amount=10), message_id="pay")
        await producer.publish(body("pay", amount=99), message_id="pay")  # key_conflict
        await producer.publish(body("bad", poison=True), message_id="bad")  # rejected
        await producer.publish(body("always"), message_id="always")  # failed, 3 deliveries
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)

        def keeping(group: str) -> BrokerConsumer:
            return self._keeping(inbox, group, topic=name, handler=handler, max_deliveries=3)

        first = keeping(self.group)
        async with running(first):  # its stop waits for the batch, the offset stored
            await wait_until(
                lambda: first.counts["dead_lettered_after_retries"] == 1, what="the dead letters"
            )
        assert first.counts == Counter(
            {"processed": 1, "key_conflict": 1, "rejected": 1, "failed": 3,
             "dead_lettered_after_retries": 1}
        )  # fmt: skip
        assert len(await self._read_all(f"{name}.dead")) == 3
        assert calls == {"pay": 1, "bad": 1, "always": 3}

        await producer.publish(body("later"), message_id="later")
        fresh = keeping(unique("lost-commits"))
        async with running(fresh):
            await wait_until(lambda: fresh.counts["processed"] == 1, what="the later record")
        assert fresh.counts == Counter({"processed": 1})  # nothing before it read again
        assert len(await self._read_all(f"{name}.dead")) == 3
        assert calls == {"pay": 1, "bad": 1, "always": 3, "later": 1}
        assert self.ledger.counts() == {"pay": 1, "later": 1}
        assert await self._stored(store, name) == {0: 5}  # past the later record too

    async def test_r13_the_offsets_of_a_deleted_topic_are_never_used_for_its_recreation(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The topic is deleted and created again between two runs (Tansu loses its topics
        on a restart; an operator may do it on Kafka), and the new log grows past the offset
        stored for the old one (6) before the consumer starts. Before, the stored offsets
        were kept under the topic's name: the new log's first six records were skipped,
        never processed. Now they are kept under the topic's name and id, a new id for the
        new topic: every record of the new log is processed, none skipped."""
        name = unique("kt1")
        create_topic(name, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)

        def keeping(group: str) -> BrokerConsumer:
            return self._keeping(inbox, group, topic=name)

        for n in range(6):
            await producer.publish(body(f"a{n}"), message_id=f"a{n}")
        first = keeping(self.group)
        async with running(first):
            await wait_until(lambda: first.counts["processed"] == 6, what="the old log")
        assert await self._stored(store, name) == {0: 6}

        await asyncio.to_thread(delete_topics, name)
        await asyncio.to_thread(create_topic, name, 1)
        for n in range(9):
            await producer.publish(body(f"b{n}"), message_id=f"b{n}")
        second = keeping(unique("after-recreate"))
        async with running(second):
            await wait_until(lambda: second.counts["processed"] == 9, what="the new log")
        assert second.counts == Counter({"processed": 9})
        assert self.ledger.counts() == {
            **{f"a{n}": 1 for n in range(6)},
            **{f"b{n}": 1 for n in range(9)},
        }
        assert await self._stored(store, name) == {0: 9}

    async def test_a_topic_deleted_and_created_again_under_a_member_is_read_from_its_start(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The topic is deleted and at once created again (four partitions again) under a
        running member, and twelve records are written to it. Before, the member kept the
        old log's positions (Tansu, like Kafka, drops the group's commits with the topic, but
        a running member never reads them again): the new log's records below them were
        skipped, never processed, without a word. Now the member looks at the topic's id,
        finds a new one, says so, and reads each partition from the new log's start: every
        record of the new log is applied (one a partition may have run before the look is
        read again and answered as a duplicate)."""
        watched = Watched(self.transport())
        watched.inner.topic_check_every = SECOND  # type: ignore[attr-defined]
        worker = self.consumer(self.apply, transport=watched)
        old = [f"a{n}" for n in range(12)]
        new = [f"b{n}" for n in range(12)]
        with caplog.at_level(logging.WARNING, logger="oncely.broker.kafka"):
            async with running(worker) as task:
                for key in old:
                    await self.publish(key)
                await wait_until(lambda: len(self.ledger.counts()) == 12, what="the old log")
                await asyncio.to_thread(delete_topics, self.source)
                await asyncio.to_thread(create_topic, self.source, PARTITIONS, self.url)
                producer = self.producer()
                for key in new:
                    await producer.publish(body(key), message_id=key)
                await wait_until(
                    lambda: task.done() or set(new) <= set(self.ledger.counts()),
                    what="every record of the new log",
                )
                assert not task.done(), f"the consumer stopped: {task.exception()!r}"
                await wait_until(self.settled, what="the new log committed")
        assert self.ledger.counts() == dict.fromkeys(old + new, 1)
        assert set(worker.counts) <= {"processed", "duplicate"}
        said = [r.getMessage() for r in caplog.records]
        assert any("the topic was deleted and created again" in text for text in said), said
        # Every look, one a second, went through one admin client (before, each look made
        # one, with its threads and connection, and dropped it).
        assert watched.inner._topic_ids.made == 1  # type: ignore[attr-defined]

    async def _partitions(self, topic: str) -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=self._servers)
        await admin.start()
        try:
            (found,) = await admin.describe_topics([topic])
            return len(found["partitions"])
        finally:
            await admin.close()

    async def test_a_topic_made_by_the_tests_keeps_their_count_over_one_tansu_made(self) -> None:
        """A client asks about a topic that does not exist (a member subscribed to it while
        the topic is away: Tansu restarted with its in-memory topics gone, or the topic
        deleted), and Tansu creates it with a partition count of its own. Before, the tests'
        create_topic then ignored "already exists": the topic made again kept Tansu's count,
        not the one it was made with. Now it has the count asked for."""
        name = unique("kt3")
        self.after(lambda: asyncio.to_thread(delete_topics, name))
        asking = AIOKafkaConsumer(
            bootstrap_servers=self._servers, group_id=unique("g"), enable_auto_commit=False
        )
        await asking.start()
        try:
            asking.subscribe([name])
            await asking.getmany(timeout_ms=1000)
        finally:
            await asking.stop()
        made = await self._partitions(name)  # Tansu's own count
        await asyncio.to_thread(create_topic, name, made + 1)
        assert await self._partitions(name) == made + 1

    async def test_r13_offsets_kept_under_the_topics_name_are_taken_over_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Rows an earlier oncely kept under the topic's name alone: one of a log that is
        still there (partition 0 at 2) is taken over under the topic's id, the partition
        starts from it, and the row is retired; one past its partition's end (partition 1
        at 50: a deleted topic's) is not used, with a WARNING naming it, rather than skip
        the new log's records."""
        name = unique("kt2")
        create_topic(name, 2)
        self.after(lambda: asyncio.to_thread(delete_topics, name, f"{name}.dead"))
        producer = KafkaProducer(self.url, name)
        self.after(producer.close)
        for n in range(12):  # each its own record key: spread over both partitions
            await producer.publish(body(f"c{n}"), message_id=f"c{n}")
        by_part: dict[int, list[str]] = {0: [], 1: []}
        for record in await self._read_all(name):
            by_part[record.partition].append(json.loads(record.value)["k"])
        assert len(by_part[0]) >= 2 and by_part[1], by_part
        expected = len(by_part[0]) - 2 + len(by_part[1])
        (inbox,) = self.inboxes("transactional", 1)
        store = inbox.store
        assert isinstance(store, oncely.AsyncPostgresStore)
        await store.prepare_offsets()
        async with store.transaction() as tx:
            await store.save_offset_in(tx, self.group, name, 0, 2)
            await store.save_offset_in(tx, self.group, name, 1, 50)
        worker = self._keeping(inbox, self.group, topic=name)
        with caplog.at_level(logging.WARNING, logger="oncely.broker.kafka"):
            async with running(worker):
                await wait_until(lambda: worker.counts["processed"] == expected, what="the records")
                await asyncio.sleep(1)  # nothing more comes
        assert worker.counts == Counter({"processed": expected})
        assert self.ledger.counts() == dict.fromkeys(by_part[0][2:] + by_part[1], 1)
        warned = [m for r in caplog.records if "past the partition's end" in (m := r.getMessage())]
        assert len(warned) == 1 and "partition=1: the stored offset 50" in warned[0]
        assert await self._stored(store, name) == {0: len(by_part[0]), 1: len(by_part[1])}
        assert await store.offsets(self.group, name) == {0: RETIRED_OFFSET, 1: RETIRED_OFFSET}

    def test_store_offsets_is_refused_where_it_cannot_hold(self) -> None:
        (inbox,) = self.inboxes("transactional", 1)
        with pytest.raises(oncely.ConfigurationError, match="mode='transactional'"):
            BrokerConsumer(self.transport(), inbox, self.apply, store_offsets=True)
        (redis_inbox,) = self.inboxes("two_phase", 1)
        with pytest.raises(oncely.ConfigurationError, match="cannot join a transaction"):
            BrokerConsumer(
                self.transport(), redis_inbox, self.apply_in, mode="transactional",
                store_offsets=True,
            )  # fmt: skip

    @pytest.mark.parametrize("given", ["no", "false", 2, 0.0, ["x"], None])
    async def test_boolean_options_take_only_a_bool(self, given: object) -> None:
        """``store_offsets``, ``handle_signals`` and the producer's ``idempotence`` took any
        value as its truth: ``store_offsets="no"`` (or ``2``, a list) stored offsets,
        ``handle_signals="no"`` took over SIGTERM. Now anything but a bool is refused,
        naming what was given."""
        (inbox,) = self.inboxes("transactional", 1)
        shown = repr(given)
        with pytest.raises(
            oncely.ConfigurationError,
            match=f"store_offsets must be True or False, not {re.escape(shown)}",
        ):
            BrokerConsumer(
                self.transport(), inbox, self.apply_in, mode="transactional", store_offsets=given
            )
        with pytest.raises(oncely.ConfigurationError, match="store_offsets must be True or False"):
            InboxProcessor(inbox, self.apply_in, mode="transactional", store_offsets=given)
        processor = InboxProcessor(inbox, self.apply_in, mode="transactional")
        with pytest.raises(oncely.ConfigurationError, match="store_offsets must be True or False"):
            BrokerConsumer(self.transport(), processor, store_offsets=given)
        worker = BrokerConsumer(self.transport(), inbox, self.apply_in, mode="transactional")
        with pytest.raises(oncely.ConfigurationError, match="handle_signals must be True or False"):
            await asyncio.wait_for(worker.run(handle_signals=given), 30)
        with pytest.raises(oncely.ConfigurationError, match="idempotence must be True or False"):
            KafkaProducer(self.url, self.source, idempotence=given)

    async def _committed(self, topic: str) -> int | None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._servers, group_id=self.group, enable_auto_commit=False
        )
        await consumer.start()
        try:
            return await consumer.committed(TopicPartition(topic, 0))  # type: ignore[no-any-return]
        finally:
            await consumer.stop()

    async def test_r14_the_producer_is_idempotent_and_keys_records_by_message_id(self) -> None:
        """librdkafka's idempotent producer, on Tansu: every copy of a message id lands in one
        partition (the record key is the id), so copies are handled one after the other."""
        producer = open_producer(self.url, self.source)
        self.after(producer.close)
        assert isinstance(producer, KafkaProducer)
        for _ in range(3):
            await producer.publish(body("same"), message_id="same")
        records = await self._read_all(self.source)
        assert len(records) == 3
        assert len({r.partition for r in records}) == 1
        assert all(r.key == b"same" for r in records)
        assert [dict(r.headers)["message-id"] for r in records] == [b"same"] * 3

    async def test_a_missing_topic_to_read_is_created_with_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A mistyped --source used to make a new, empty topic with only an INFO line.
        name = unique("kafka_missing")
        made = Kafka(self.url, name, group=unique("g"), session_timeout=SESSION, revoke_grace=GRACE)
        try:
            with caplog.at_level(logging.INFO, logger="oncely"):
                await made.open(1)
        finally:
            await made.close()
        created = [r for r in caplog.records if "created topics" in r.getMessage()]
        assert [r.levelno for r in created] == [logging.WARNING]
        assert name in created[0].getMessage() and "one replica" in created[0].getMessage()

    async def test_a_dead_letter_copy_keeps_a_null_value_and_null_headers(self) -> None:
        """A tombstone (null value) with a null header is refused and dead-lettered. Before,
        the copy carried b"" for both, which a reader of the dead-letter topic cannot tell
        from an empty body or an empty header; now both stay null. The reason says what a
        tombstone is and how to take them (it said "there is nothing to process", which on
        a compacted topic is wrong: a tombstone deletes its key), and no handler sees it."""
        producer = await self._raw_producer()
        await producer.send(
            self.source, None, [("message-id", b"tomb"), ("trace", None)], key=b"k1"
        )
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["rejected"] == 1, what="the dead letter")
        (copy,) = await self._read_all(f"{self.source}.dead")
        headers = dict(copy.headers)
        assert copy.value is None and copy.key == b"k1"
        assert headers["trace"] is None and headers["message-id"] == b"tomb"
        reason = headers["x-oncely-reason"].decode()
        assert "tombstone" in reason and "deletion of its record key" in reason
        assert "tombstones='handle'" in reason and "oncely.brokers.kafka.Tombstone" in reason
        assert worker.counts == Counter({"rejected": 1}) and self.ledger.counts() == {}

    @pytest.mark.parametrize("mode", ["transactional", "two_phase"])
    async def test_tombstones_handle_hands_them_to_the_handler_as_tombstone(
        self, mode: str
    ) -> None:
        """``tombstones="handle"``: a compacted topic's consumer deletes the row a tombstone
        names, in the marker's transaction. Before, every tombstone was dead-lettered and the
        row it deletes stayed. The handler tells a tombstone (a :class:`Tombstone` holding
        the record key) from an empty body (``""`` as text/plain, never a Tombstone); a
        tombstone is keyed by its message id like any record (R2): the producer's retry is
        a duplicate, and a tombstone without one is dead-lettered, never run unprotected."""
        producer = KafkaProducer(self.url, self.source)
        self.after(producer.close)
        await producer.publish(body("a"), message_id="put-a", key="a")
        await producer.publish(None, message_id="del-a", key="a")
        await producer.publish(None, message_id="del-a", key="a")  # the producer's retry
        await producer.publish(body("b"), message_id="put-b", key="b")
        await producer.publish(b"", message_id="empty-c", key="c", content_type="text/plain")
        raw = await self._raw_producer()
        await raw.send(self.source, None, [], key=b"d")  # a foreign tombstone: no message id
        seen: list[object] = []
        table = self.ledger.table

        async def keep_in(tx: Any, payload: object) -> None:
            seen.append(payload)
            if isinstance(payload, Tombstone):  # the record of its key is deleted
                await tx.execute(f"DELETE FROM {table} WHERE key = %s", (payload.text,))
            elif isinstance(payload, str):  # an empty text/plain body
                await self.ledger.apply_in(tx, "c", payload)
            else:
                await self.apply_in(tx, payload)  # type: ignore[arg-type]

        async def keep(payload: object) -> None:
            async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as c:
                await keep_in(c, payload)

        worker = self.consumer(
            keep_in if mode == "transactional" else keep,
            mode=mode,  # type: ignore[arg-type]
            transport=self.transport(tombstones="handle"),
        )
        async with running(worker):
            await wait_until(lambda: sum(worker.counts.values()) == 6, what="six records")
        assert worker.counts == Counter({"processed": 4, "duplicate": 1, "rejected": 1})
        assert self.ledger.counts() == {"b": 1, "c": 1}
        assert Tombstone(b"a") in seen and "" in seen and len(seen) == 4
        assert [p for p in seen if isinstance(p, Tombstone)] == [Tombstone(b"a")]
        (copy,) = await self._read_all(f"{self.source}.dead")
        assert copy.value is None and copy.key == b"d"
        assert b"message id" in dict(copy.headers)["x-oncely-reason"]

    async def _committed_all(self) -> dict[int, int | None]:
        """The group's committed offset of each partition of the source."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._servers, group_id=self.group, enable_auto_commit=False
        )
        await consumer.start()
        try:
            return {
                p: await consumer.committed(TopicPartition(self.source, p))
                for p in range(PARTITIONS)
            }
        finally:
            await consumer.stop()

    @pytest.mark.parametrize("tombstones", ["dead_letter", "handle"])
    async def test_r2_a_tombstone_without_record_key_or_message_id_is_dead_lettered(
        self, tombstones: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A foreign producer (librdkafka; aiokafka refuses to) can write a record with
        neither value nor record key: a tombstone naming no key. Without a ``message-id``
        header it has no key of its own either (R2). Each such record is dead-lettered on
        its own, never merged with another under one key: by default refused as a
        tombstone, with ``tombstones="handle"`` refused for its missing message id (never
        keyed on the absent record key). Its copy keeps the null value and the null record
        key (the dead-letter producer writes both), the offset is committed past it, and the
        record after it in its partition is processed: no crash, no stalled partition, no
        redelivery loop, nothing dropped. The reason, the partition and the offset are in
        the consumer's ERROR line and in the copy's headers (R16). With a message id, a
        keyless tombstone is keyed by it: handed out as ``Tombstone(None)`` under
        ``tombstones="handle"``."""
        produce_raw(
            self.url,
            self.source,
            [
                (None, None, []),
                (None, None, []),
                (None, None, [("message-id", b"keyless-del")]),
                (body("after"), b"after", [("message-id", b"after")]),
            ],
        )
        seen: list[object] = []

        async def keep(payload: object) -> None:
            seen.append(payload)
            if not isinstance(payload, Tombstone):
                await self.apply(payload)  # type: ignore[arg-type]

        async def committed_past_all() -> bool:
            return (await self._committed_all())[0] == 4

        worker = self.consumer(keep, transport=self.transport(tombstones=tombstones))
        with caplog.at_level(logging.ERROR, logger="oncely.broker"):
            async with running(worker):
                await wait_until(lambda: sum(worker.counts.values()) == 4, what="four records")
                await wait_until(committed_past_all, what="the commit past all four")
        handled = tombstones == "handle"
        assert worker.counts == Counter({"rejected": 3 - handled, "processed": 1 + handled})
        assert seen == ([Tombstone(None)] if handled else []) + [{"k": "after"}]
        assert self.ledger.counts() == {"after": 1}
        copies = await self._read_all(f"{self.source}.dead")
        assert all(copy.value is None and copy.key is None for copy in copies)
        headers = [dict(copy.headers) for copy in copies]
        offsets = sorted(h["x-oncely-offset"] for h in headers)
        assert offsets == ([b"0", b"1"] if handled else [b"0", b"1", b"2"])
        assert [h.get("message-id") for h in headers].count(b"keyless-del") == 1 - handled
        lines = [r.getMessage() for r in caplog.records if "action=dead_letter" in r.getMessage()]
        assert len(lines) == len(copies)
        for h in headers:
            reason = h["x-oncely-reason"].decode()
            if handled:
                assert "no producer-assigned message id" in reason
            else:
                assert "tombstone" in reason and "tombstones='handle'" in reason
            where = f"partition=0 offset={h['x-oncely-offset'].decode()} "
            assert [line for line in lines if where in line and reason in line]

    async def _dead_letter_order(self) -> dict[tuple[int, int], list[int]]:
        """The ``x-oncely-offset`` of each copy in the dead-letter topic, by (partition of the
        copy, partition of the record it copies), in the order of the copies."""
        found: dict[tuple[int, int], list[int]] = {}
        copies = await self._read_all(f"{self.source}.dead")
        for copy in sorted(copies, key=lambda r: (r.partition, r.offset)):
            headers = dict(copy.headers)
            source = int(headers["x-oncely-partition"])
            found.setdefault((copy.partition, source), []).append(int(headers["x-oncely-offset"]))
        return found

    async def test_r15_the_dead_letters_of_one_partition_keep_its_order(self) -> None:
        """Fifty records of each of two partitions, every one refused (a body that is not
        JSON), all read in one batch. Before, their outcomes were carried out all at once,
        and the copies of the first batch's dead letters waited on the producer's first look
        at the dead-letter topic side by side: they landed in the topic in any order (the
        copy of offset 1 before that of offset 0), and a user re-sending dead letters in
        order, or compacting the dead-letter topic by record key (a tombstone overtaking
        the value it deletes), got them reordered. Now the outcomes of one partition are
        carried out in its order, the partitions side by side: the copies of each follow
        its offsets (R15). Each record of a partition has the partition's record key, so
        its copies share a partition of the dead-letter topic."""
        n = 50
        for partition in (0, 1):
            produce_raw(
                self.url,
                self.source,
                [
                    (b"not json %d" % i, b"entity-%d" % partition, [("message-id", b"m-%d" % i)])
                    for i in range(n)
                ],
                partition=partition,
            )
        worker = self.consumer(self.apply, batch=4 * n)
        async with running(worker):
            await wait_until(lambda: worker.counts["rejected"] == 2 * n, what="every record")
        assert worker.counts == Counter({"rejected": 2 * n})
        order = await self._dead_letter_order()
        assert sorted(source for _, source in order) == [0, 1]
        for offsets in order.values():
            assert offsets == list(range(n)), offsets

    async def test_r15_a_refused_record_is_dead_lettered_before_the_later_ones_of_its_partition(
        self,
    ) -> None:
        """One batch: in partition 0 a record refused before processing (not JSON), then one
        whose handler fails (``max_deliveries=1``: dead-lettered); in partition 1 a record
        whose handler blocks. Partition 0's run ends first and is settled while partition 1
        runs. Before, its refused record was left for the end of the batch: the failed
        record's copy was written first, the refused one's only once the blocked handler
        ended, out of the partition's order. Now a refused record is settled with its
        partition's run: its copy comes first (R15)."""
        started, release = asyncio.Event(), asyncio.Event()

        async def handler(payload: dict[str, Any]) -> None:
            if payload["k"] == "blocks":
                started.set()
                await release.wait()
            if payload["k"] == "fails":
                raise RuntimeError("the handler fails")
            await self.apply(payload)

        produce_raw(
            self.url,
            self.source,
            [
                (b"not json", b"entity", [("message-id", b"refused")]),
                (body("fails"), b"entity", [("message-id", b"fails")]),
            ],
        )
        produce_raw(
            self.url,
            self.source,
            [(body("blocks"), b"other", [("message-id", b"blocks")])],
            partition=1,
        )

        async def copied() -> bool:
            return bool(await self._dead_letter_order())

        worker = self.consumer(handler, max_deliveries=1)
        async with running(worker):
            await asyncio.wait_for(started.wait(), 60)
            await wait_until(copied, what="partition 0's first dead letter, while 1 runs")
            release.set()
            outcomes = ("processed", "rejected", "failed")
            await wait_until(
                lambda: [worker.counts[o] for o in outcomes] == [1, 1, 1], what="all three"
            )
        assert list((await self._dead_letter_order()).values()) == [[0, 1]]

    async def test_the_tombstones_option_takes_dead_letter_or_handle_only(self) -> None:
        assert self.transport().tombstones == "dead_letter"
        made = open_transport(f"{self.url}?tombstones=handle", self.source, group=self.group)
        assert isinstance(made, Kafka) and made.tombstones == "handle"
        with pytest.raises(oncely.ConfigurationError, match="tombstones must be one of"):
            open_transport(f"{self.url}?tombstones=yes", self.source, group=self.group)
        for given in ("yes", True, "Handle", None):
            with pytest.raises(oncely.ConfigurationError, match=f"not {re.escape(repr(given))}"):
                self.transport(tombstones=given)
        producer = KafkaProducer(self.url, self.source)
        self.after(producer.close)
        with pytest.raises(oncely.ConfigurationError, match="give the key it deletes"):
            await producer.publish(None, message_id="del-x")

    async def test_a_key_header_given_twice_with_two_values_is_refused_not_read_as_the_first(
        self,
    ) -> None:
        """A record may repeat a header name. Keyed on ``order``: records whose ``order``
        headers disagree were keyed on the first one, silently, so ``[o-1, o-2]`` and
        ``[o-1, o-3]`` (each a message of its own to a reader taking the last, as Kafka's
        ``Headers.lastHeader`` does) were one key, the second dropped as a duplicate. Now
        such a record is dead-lettered with both values in the reason; a repeat with one value
        is still read, and so is a record keyed elsewhere that repeats a header."""
        producer = await self._raw_producer()
        sends = [
            ("a", [("order", b"o-1"), ("order", b"o-2")]),
            ("b", [("order", b"o-1"), ("order", b"o-3")]),
            ("c", [("order", b"o-4"), ("order", b"o-4")]),
            ("d", [("ce_id", b"e-1"), ("ce_id", b"e-2"), ("ce_source", b"/s"), ("order", b"o-5")]),
        ]
        for k, headers in sends:
            await producer.send(self.source, body(k), headers, key=None)
        worker = self.consumer(self.apply, key=oncely.HeaderKey("order"))
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] + worker.counts["rejected"] == 4,
                what="four records settled",
            )
        assert self.ledger.counts() == {"c": 1, "d": 1}
        dead = await self._read_all(f"{self.source}.dead")
        reasons = sorted(dict(copy.headers)["x-oncely-reason"].decode() for copy in dead)
        assert len(reasons) == 2
        assert all("'order'" in r and "'o-1'" in r and "different values" in r for r in reasons)
        assert "'o-2'" in reasons[0] and "'o-3'" in reasons[1]

    async def test_cloudevents_ids_given_twice_with_two_values_are_refused(self) -> None:
        """The same for the CloudEvents id and source: two ``ce_id`` headers that disagree
        name no one event."""
        producer = await self._raw_producer()
        await producer.send(
            self.source,
            body("a"),
            [("ce_id", b"e-1"), ("ce_id", b"e-2"), ("ce_source", b"/s")],
            key=None,
        )
        await producer.send(
            self.source, body("b"), [("ce_id", b"e-3"), ("ce_source", b"/s")], key=None
        )
        worker = self.consumer(self.apply, key=oncely.CloudEventsKey())
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] + worker.counts["rejected"] == 2,
                what="two records settled",
            )
        assert self.ledger.counts() == {"b": 1}
        (copy,) = await self._read_all(f"{self.source}.dead")
        reason = dict(copy.headers)["x-oncely-reason"].decode()
        assert "'ce_id'" in reason and "'e-1'" in reason and "'e-2'" in reason

    async def test_a_member_left_without_a_partition_says_so(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Two members of one group on a topic of one partition: one of them reads nothing.
        Before, nothing said so (a group stuck in its rebalance looked the same: a consumer
        silent for good). Now that member warns, once, naming the topic's partition count."""
        topic = unique("kt1")
        create_topic(topic, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, topic, f"{topic}.dead"))
        members = []
        for _ in range(2):
            made = Kafka(
                self.url, topic, group=self.group, session_timeout=SESSION, revoke_grace=GRACE
            )
            made._unassigned_after = 3.0  # 60 s or more in use
            members.append(self.closed_after(made))
        workers = [self.consumer(self.apply, transport=m) for m in members]

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "no partition for" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="oncely"):
            async with running(workers[0]), running(workers[1]):
                await wait_until(
                    lambda: sum(len(m.assignment) for m in members) == 1 and bool(warned()),
                    what="one member owning the partition, the other saying it owns none",
                )
        (said,) = warned()
        assert f"topic={topic}" in said and "topic's 1 partitions" in said

    async def test_a_slow_handler_in_a_batch_holds_up_only_its_own_partition(self) -> None:
        """Batch mode (the default): one record's handler blocks. Before, the batch it came
        in was settled only once every handler ended, and the next batch was read only
        then: every partition stalled behind the one slow record. Now each partition's run
        is settled as it ends and the next batch is read meanwhile: records published while
        the slow one runs are processed, except those behind it in its own partition, which
        wait for it (order kept)."""
        started, release = asyncio.Event(), asyncio.Event()

        async def handler(payload: dict[str, Any]) -> None:
            if payload["k"] == "slow":
                started.set()
                await release.wait()
            await self.apply(payload)

        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        await producer.publish(body("slow"), message_id="slow")
        worker = self.consumer(handler)
        async with running(worker):
            await asyncio.wait_for(started.wait(), 60)
            later = [f"l{n}" for n in range(12)]
            for key in later:
                await producer.publish(body(key), message_id=key)
            where = {
                json.loads(r.value)["k"]: r.partition for r in await self._read_all(self.source)
            }
            free = {k for k in later if where[k] != where["slow"]}
            assert free, where  # twelve keys spread over four partitions
            await wait_until(
                lambda: free <= set(self.ledger.counts()),
                what="the records of the other partitions, while the slow one runs",
            )
            assert not set(later) - free & set(self.ledger.counts())  # behind it: waiting
            release.set()
            await wait_until(
                lambda: set(self.ledger.counts()) == {"slow", *later}, what="all of them"
            )
        assert set(self.ledger.counts().values()) == {1}

    async def test_a_partition_is_not_starved_by_another_partitions_backlog(self) -> None:
        """Batch mode (the default): a backlog of thousands of records on one partition, and
        a few records published to another while the backlog runs. Before, the transport
        handed out the backlog's buffered records at every fetch without taking what the
        client had fetched of the other partition (the client gives its records out
        partition by partition, the backlog's whole fetch first), and a batch's room went
        to the first partition in turn: the few ran only once the whole backlog had. Now
        each partition's fetched records are taken at every fetch and a batch's room is
        shared among the partitions with records ready: partitions run side by side, as
        the Kafka docs promise (the order of the effects shows it). The backlog's first
        record is held until the client has fetched the few: how soon a fetch brings them
        (the client's and the broker's pace, against the backlog's) is not what is checked."""
        handled: list[str] = []
        fetched = asyncio.Event()

        async def handler(payload: dict[str, Any]) -> None:
            handled.append(payload["k"])
            if payload["k"] == "a0":
                await fetched.wait()
            await asyncio.sleep(0)

        backlog = [f"a{n}" for n in range(3000)]
        few = [f"b{n}" for n in range(3)]
        producer = AIOKafkaProducer(bootstrap_servers=self._servers, linger_ms=5)
        await producer.start()

        def headers(key: str) -> list[tuple[str, bytes]]:
            return [("message-id", key.encode()), ("content-type", b"application/json")]

        async def publish(keys: list[str], partition: int) -> None:
            sent = []
            for key in keys:
                sent.append(
                    await producer.send(
                        self.source, body(key), partition=partition, headers=headers(key)
                    )
                )
            await asyncio.gather(*sent)

        try:
            await publish(backlog, 0)
            worker = self.consumer(handler)
            transport = worker.transport
            assert isinstance(transport, Kafka)
            async with running(worker):
                await wait_until(lambda: "a0" in handled, what="the backlog's first record")
                # One batch: a fetch brings all of the few or none of them.
                batch = producer.create_batch()
                for key in few:
                    batch.append(key=None, value=body(key), timestamp=None, headers=headers(key))
                await (await producer.send_batch(batch, self.source, partition=1))
                client = transport._consumer
                assert client is not None
                other = TopicPartition(self.source, 1)
                await wait_until(
                    lambda: (client.highwater(other) or 0) > 0,
                    what="the client fetching the few, the backlog's first batch held",
                )
                fetched.set()
                await wait_until(
                    lambda: worker.counts["processed"] == len(backlog) + len(few),
                    what="every record",
                    timeout=timedelta(seconds=120),
                )
        finally:
            await producer.stop()
        assert sorted(handled) == sorted(backlog + few)
        # The few were fetched while the backlog's first batch ran, with more of the backlog
        # fetched behind it: they run in the next batch (each up to ``batch_default``
        # records), not behind the buffer, nor behind the whole backlog (where they ran
        # before).
        last_of_few = max(handled.index(k) for k in few)
        assert last_of_few < 2 * Kafka.batch_default, last_of_few

    async def test_open_transport_reads_kafka_urls(self) -> None:
        made = open_transport(f"{self.url}?session_timeout=6&partitions=2", self.source, group="g")
        assert isinstance(made, Kafka)
        assert made.session_timeout == SESSION and made.partitions == 2
        assert made.dead_letter == f"{self.source}.dead"
        with pytest.raises(oncely.ConfigurationError, match="unknown option"):
            open_transport(f"{self.url}?nope=1", self.source, group="g")
        # An error names the URL as given, every broker and the password hidden included.
        given = "kafka://app:s3cret@kafka-a.internal:9092,kafka-b.internal:9092?nope=1"
        with pytest.raises(oncely.ConfigurationError) as refused:
            open_transport(given, self.source, group="g")
        said = str(refused.value)
        assert said.startswith("kafka://app:***@kafka-a.internal:9092,kafka-b.internal:9092")
        assert "s3cret" not in said and "localhost" not in said
        with pytest.raises(oncely.ConfigurationError, match="topic name"):
            Kafka(self.url, "bad topic", group="g")
        with pytest.raises(oncely.ConfigurationError, match=r"'partitions' in the URL is read by"):
            Kafka(f"{self.url}?partitions=2", self.source, group="g")  # a keyword argument here
        with pytest.raises(oncely.ConfigurationError, match=r"'linger' in the URL is read by"):
            KafkaProducer(f"{self.url}?linger=0.1", self.source)

    async def test_a_producer_whose_broker_never_answers_says_so_once_not_at_every_retry(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """librdkafka reports a broker name that does not resolve at every reconnect (about
        ten lines a second); the producer's log carries it once, and the publish fails with
        BrokerUnavailable at its timeout."""
        caplog.set_level(logging.DEBUG, logger="oncely.broker.kafka")
        producer = KafkaProducer(
            "kafka://nohost.invalid:9092",
            self.source,
            timeout=timedelta(seconds=3),
            connect_timeout=timedelta(seconds=3),
        )
        try:
            with pytest.raises(oncely.BrokerUnavailable):
                await producer.publish(b"{}", message_id="m-1")
        finally:
            await producer.close()
        lines = [r for r in caplog.records if r.name.startswith("oncely.broker.kafka")]
        resolving = [r for r in lines if "Failed to resolve" in r.getMessage()]
        assert 1 <= len(resolving) <= 2, [r.getMessage() for r in lines]

    async def test_records_of_one_partition_run_in_order_partitions_side_by_side(self) -> None:
        """Twelve records of four entities (the record key), each handler slow: within a
        partition the effects follow the offsets, and partitions run side by side."""
        running_now: set[str] = set()
        most = 0
        handled: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal most
            running_now.add(payload["k"])
            most = max(most, len(running_now))
            await asyncio.sleep(0.05)
            handled.append(payload["k"])
            running_now.discard(payload["k"])
            await self.apply(payload)

        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        for n in range(12):
            await producer.publish(body(f"o{n}"), message_id=f"o{n}", key=f"entity-{n % 4}")
        in_partition: dict[int, list[str]] = {}
        for record in sorted(await self._read_all(self.source), key=lambda r: r.offset):
            in_partition.setdefault(record.partition, []).append(
                dict(record.headers)["message-id"].decode()
            )
        worker = self.consumer(handler, concurrency=4)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 12, what="all twelve")
        assert sorted(handled) == sorted(f"o{n}" for n in range(12))
        for keys in in_partition.values():
            assert [k for k in handled if k in keys] == keys
        if len(in_partition) > 1:
            assert most >= 2
        assert worker.counts == Counter({"processed": 12})
        await self.assert_settled()

    async def test_r10_r15_a_partition_waits_behind_a_record_given_back_while_it_runs(
        self,
    ) -> None:
        """One partition: A's claim lapsed (its worker died), and while the inbox's reconciler
        (``on_stale``) looks the work up, another member (an old owner of the partition, with
        the same records) takes A over: A is given back ``in_flight`` after the batch's claim.
        Before, only a failure held back the rest of a partition there, so B and C ran ahead
        of A (R15: a partition is an order)."""
        store = oncely.AsyncMemoryStore()
        taken: list[oncely.StaleClaim] = []

        async def reconcile(stale: oncely.StaleClaim) -> oncely.Resolution:
            if not taken:  # the other member took A over meanwhile
                other = await store.takeover(
                    self.group,
                    stale.record.key,
                    expected_token=stale.record.token,
                    fingerprint=None,
                    token="other",
                    lease_ms=3000,  # A is given back for what is left of it
                    keep_ms=86_400_000,
                )
                assert other.won
                taken.append(stale)
            return oncely.Resolution.retry()

        inbox = oncely.AsyncInbox(store, consumer=self.group, on_stale=reconcile)
        self.after(inbox.aclose)
        dead = await store.claim(
            self.group,
            "A",
            fingerprint=None,
            token="dead",
            lease_ms=100,
            keep_ms=86_400_000,
            takeover=False,
        )
        assert dead.won
        await asyncio.sleep(0.3)  # the dead worker's lease lapses
        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        for k in ("A", "B", "C"):
            await producer.publish(body(k), message_id=k, key="one-entity")
        handled: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            handled.append(payload["k"])
            await self.apply(payload)

        worker = self.consumer(handler, inbox=inbox)
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] >= 1, what="A given back")
            await store.release(self.group, "A", token="other")
            await wait_until(lambda: "A" in handled, what="A run once released")
            await wait_until(lambda: len(handled) >= 3, what="the partition's three records")
        assert len(taken) == 1
        assert handled == ["A", "B", "C"]
        assert self.ledger.counts() == {"A": 1, "B": 1, "C": 1}
        await self.assert_settled()

    async def test_r8_r15_a_partition_goes_on_once_the_holder_of_its_held_record_completes(
        self,
    ) -> None:
        """One partition: A's key is held by another worker under a two-minute lease, B and
        C follow it. A is ``in_flight`` and kept while the consumer watches its key; B and C
        wait behind it (the partition's order). Once the holder completes, A is finished as
        a ``duplicate`` on its one delivery, and B and C run, in order. Before, A was given
        back for all that was left of the lease (two minutes) and the partition waited that
        long behind it: the wait below gives up long before (R8, R15)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "A")
        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        for k in ("A", "B", "C"):
            await producer.publish(body(k), message_id=k, key="one-entity")
        handled: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            handled.append(payload["k"])
            await self.apply(payload)

        watched = Watched(self.transport())
        worker = self.consumer(handler, inbox=inbox, transport=watched)
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] >= 1, what="A in_flight")
            assert handled == []  # B and C wait behind A
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
            await wait_until(
                lambda: worker.counts["processed"] == 2,
                timeout=timedelta(seconds=30),
                what="A finished as a duplicate, then B and C run",
            )
        assert handled == ["B", "C"]
        assert worker.counts["duplicate"] == 1
        assert set(worker.counts) == {"in_flight", "duplicate", "processed"}, worker.counts
        assert watched.counts("A") == [1]  # one delivery, never given back
        assert self.ledger.counts() == {"B": 1, "C": 1}
        await self.assert_settled()

    async def test_r8_r15_a_freed_copy_waiting_for_a_slot_is_given_back_on_revocation(
        self,
    ) -> None:
        """A's key is held by another worker; A is ``in_flight`` and watched. B, on another
        partition, takes the one slot (its handler blocks). The holder completes: A is
        freed and waits for the slot to run in. Another member joins the group and A's
        partition is revoked: A is given back at once for its next owner, not kept until
        B's handler ends. Before, the wait for a slot woke on a stop only: A stayed out
        past the revocation, for as long as B ran (R8, R15)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "A")
        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        await producer.publish(body("A"), message_id="A", key="a-entity")
        (a,) = await self._read_all(self.source)
        count = await self._partitions(self.source)
        b_key = next(  # B on a partition of its own (librdkafka's consistent partitioner)
            k
            for k in (f"b-{n}" for n in range(1000))
            if zlib.crc32(k.encode()) % count != a.partition
        )
        started, release = asyncio.Event(), asyncio.Event()

        async def handler(payload: dict[str, Any]) -> None:
            if payload["k"] == "B":
                started.set()
                await release.wait()
            await self.apply(payload)

        watched = Requeues(self.transport())
        worker = self.consumer(handler, inbox=inbox, transport=watched, concurrency=1)
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] == 1, what="A in_flight")
            await producer.publish(body("B"), message_id="B", key=b_key)
            where = {r.value: r.partition for r in await self._read_all(self.source)}
            assert where[body("B")] != a.partition, where
            await asyncio.wait_for(started.wait(), 60)
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
            await wait_until(
                lambda: bool(worker._slots._waiters), what="A freed, waiting for the slot"
            )
            assert watched.requeued == []
            other = AIOKafkaConsumer(
                self.source,
                bootstrap_servers=self._servers,
                group_id=self.group,
                enable_auto_commit=False,
                session_timeout_ms=int(SESSION.total_seconds() * 1000),
            )
            await other.start()
            try:
                await wait_until(
                    lambda: "A" in watched.requeued,
                    timeout=timedelta(seconds=30),
                    what="A given back on the revocation, while B still runs",
                )
                assert not release.is_set()
            finally:
                release.set()
                await other.stop()
            await wait_until(
                lambda: worker.counts["duplicate"] == 1 and worker.counts["processed"] == 1,
                what="A a duplicate at its next delivery, B processed",
            )
        assert self.ledger.counts() == {"B": 1}

    async def test_r13_a_record_held_back_behind_a_failing_one_keeps_its_own_retries(
        self,
    ) -> None:
        """One partition: A always fails, B fails once, C succeeds. B waits behind A's retries
        (the partition's order is kept), and each wait gave it back. Before, every give-back
        counted as one of B's deliveries: once A was dead-lettered, B was dead-lettered on
        its first failure ("failed on all 4 deliveries") although it had run once."""
        attempts = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            key = payload["k"]
            attempts[key] += 1
            if key == "A" or (key == "B" and attempts[key] == 1):
                raise RuntimeError(f"boom {attempts[key]} for {key}")
            await self.apply(payload)

        producer = self.producer()
        assert isinstance(producer, KafkaProducer)
        for k in ("A", "B", "C"):
            await producer.publish(body(k), message_id=k, key="one-entity")
        watched = Watched(self.transport())
        worker = self.consumer(handler, transport=watched, max_deliveries=3)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] == 2,
                what="B retried and applied, C applied",
            )
        assert attempts == {"A": 3, "B": 2, "C": 1}
        # B was handed out behind A and given back unrun (at least once: the three came in
        # one poll), which no longer counts: its two runs are its deliveries 1 and 2.
        seen = watched.counts("B")
        assert len(seen) >= 3 and seen[-1] == 2 and max(c or 0 for c in seen) == 2, seen
        assert self.ledger.counts() == {"B": 1, "C": 1}
        (copy,) = await self.dead_letters()
        assert copy.message_id == "A"
        await self.assert_settled()

    async def test_r13_a_failing_record_keeps_its_count_through_a_rebalance(self) -> None:
        """One partition, one record that always fails, ``max_deliveries=3``. After its first
        run another member joins the group and leaves again: the rebalances take the
        partition away and give it back. Before, the member forgot the record's runs with
        the partition and counted from 1 again: four runs or more before the dead letter
        (a group rebalancing faster than the backoff never dead-lettered it, and its
        partition stalled for good). Now it goes on counting: three runs in all."""
        topic = unique("kt1")
        create_topic(topic, 1)
        self.after(lambda: asyncio.to_thread(delete_topics, topic, f"{topic}.dead"))
        runs: list[str] = []
        assigned = 0

        class Counted(Kafka):
            async def _assigned(self, consumer: Any, tps: set[TopicPartition]) -> None:
                nonlocal assigned
                assigned += 1
                await super()._assigned(consumer, tps)

        async def handler(payload: dict[str, Any]) -> None:
            runs.append(payload["k"])
            raise RuntimeError(f"boom {len(runs)}")

        made = self.closed_after(
            Counted(self.url, topic, group=self.group, session_timeout=SESSION, revoke_grace=GRACE)
        )
        producer = self.closed_after(KafkaProducer(self.url, topic))
        await producer.publish(body("F"), message_id="F")
        wait = timedelta(seconds=6)  # the rebalances end before the third run
        worker = self.consumer(
            handler,
            transport=made,
            max_deliveries=3,
            backoff=oncely.brokers.Backoff(first=wait, factor=1.0, most=wait),
        )
        async with running(worker):
            await wait_until(lambda: len(runs) == 1, what="the first run")
            other = AIOKafkaConsumer(
                topic,
                bootstrap_servers=self._servers,
                group_id=self.group,
                enable_auto_commit=False,
                session_timeout_ms=int(SESSION.total_seconds() * 1000),
            )
            await other.start()
            try:
                await wait_until(
                    lambda: bool(other.assignment()) or assigned > 1,
                    what="a rebalance with the second member in the group",
                )
            finally:
                await other.stop()
            await wait_until(
                lambda: worker.counts["dead_lettered_after_retries"] == 1, what="the dead letter"
            )
        assert runs == ["F"] * 3
        (dead,) = await self._read_all(f"{topic}.dead")
        assert dict(dead.headers)["x-oncely-deliveries"] == b"3"

    async def test_a_rebalance_with_three_members_joining_and_leaving_loses_and_repeats_nothing(
        self,
    ) -> None:
        """400 records over four partitions; a first member starts, a second and a third join
        while it runs, then the first and the second leave. Every record's effect is applied
        once (the marker commits with it), none is lost, and no member ever commits an offset
        with a record before it unfinished: each commit is checked as it is sent against the
        records every member has finished. (Not asserted: how many records are handed out
        again; Tansu accepts a commit from a member that lost its partitions, so it may
        repeat more than a Kafka broker would.)"""
        finished: dict[int, set[int]] = {}
        bad: list[str] = []

        class Checked(Kafka):
            def _settled(
                self, part: Any, held: Any, state: int, delay: float = 0.0, counted: bool = True
            ) -> None:
                if state == DONE and held.state == RUNNING and part.owned:
                    finished.setdefault(part.tp.partition, set()).add(held.record.offset)
                super()._settled(part, held, state, delay, counted)

            async def open(self, prefetch: int) -> None:
                await super().open(prefetch)
                consumer = self._consumer
                assert consumer is not None
                commit = consumer.commit

                async def checked(offsets: Any = None) -> None:
                    for tp, meta in offsets.items():
                        missing = set(range(meta.offset)) - finished.get(tp.partition, set())
                        if missing:
                            bad.append(f"partition {tp.partition} at {meta.offset}: {missing}")
                    await commit(offsets)

                consumer.commit = checked

        keys = [f"r{n}" for n in range(RECORDS)]
        for key in keys:
            await self.publish(key)
        inboxes = self.inboxes("transactional", 3)

        async def slow_in(tx: Any, payload: dict[str, Any]) -> None:
            await self.apply_in(tx, payload)
            await asyncio.sleep(0.04)  # four partitions: about 100 records a second

        def member(n: int) -> Any:
            made = Checked(
                self.url, self.source, group=self.group, session_timeout=SESSION,
                revoke_grace=GRACE,
            )  # fmt: skip
            self.closed_after(made)
            self._made.append(made)
            return self.consumer(slow_in, mode="transactional", inbox=inboxes[n], transport=made)

        workers = [member(n) for n in range(3)]

        def done() -> int:
            return len(self.ledger.counts())

        tasks: list[asyncio.Task[None]] = []

        async def progress(what: str) -> None:
            at = done()
            await wait_until(lambda: done() >= min(at + 25, RECORDS), what=what)

        async def leave(n: int) -> None:
            workers[n].stop()
            await asyncio.wait_for(tasks[n], 60)

        try:
            for n in range(3):  # each joins while the others run
                tasks.append(asyncio.create_task(workers[n].run()))
                await wait_until(lambda n=n: self._reading(n + 1), what=f"{n + 1} members")
                await progress(f"progress with {n + 1} members")
            await leave(0)
            await progress("progress after the first left")
            await leave(1)
            await wait_until(lambda: done() == RECORDS, what="every effect")
            await wait_until(self.settled, what="every offset committed")
        finally:
            for worker in workers:
                worker.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert self.ledger.counts() == dict.fromkeys(keys, 1)
        assert bad == []
        counts = total(*workers)
        assert counts["processed"] == RECORDS
        assert set(counts) <= {"processed", "duplicate", "in_flight"}
        assert sum(1 for w in workers if w.counts["processed"] > 0) >= 2
        assert await self.dead_letters() == []


class Requeues(Watched):
    """A transport that notes, by message id, every record given back unrun (``requeue``)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.requeued: list[str | None] = []

    def _saw(self, found: list[Any]) -> list[Any]:
        for delivery in found:
            assert isinstance(delivery, KafkaDelivery)
            delivery.__class__ = _NotedRequeue
        _NotedRequeue.noted = self.requeued
        return super()._saw(found)


class _NotedRequeue(KafkaDelivery):
    __slots__ = ()
    noted: ClassVar[list[str | None]]

    async def requeue(self, delay: timedelta) -> None:
        self.noted.append(self.envelope.message_id)
        await super().requeue(delay)
