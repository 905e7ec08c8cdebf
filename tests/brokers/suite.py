"""The behaviours every broker adapter shares, written once and run against each real broker.

:class:`BrokerSuite` holds one test method per behaviour. Each broker's module subclasses it
(``test_rabbitmq.py::TestRabbitMQ``, ``test_redis_streams.py::TestRedisStreams``,
``test_nats.py::TestJetStream``), implements the small interface at the top of the class (its
transport on this test's source, a publish without any message id, the dead-letter destination
read back, what the broker still holds) and adds the tests only its broker has. Adding a broker
is one adapter package plus one subclass.

Every scenario ends by checking the facts: each logical message's effect is one ledger row (no
unique constraint: a double effect would show), nothing lost, nothing dead-lettered that should
not be, and nothing left unacknowledged on the broker once the test's consumers are gone.
Transactional mode runs on PostgreSQL (the effect and the marker in one transaction, R7);
two-phase mode on Redis, with a 1 s lease that the heartbeat keeps renewing (R10).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal, TypeVar, cast
from urllib.parse import parse_qs

import pytest
import redis.asyncio

import oncely
from oncely._core.observe import key_for_logs
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    BrokerLimits,
    ConsumerSettings,
    Delivery,
    Producer,
    Transport,
    cloudevent_headers,
    open_producer,
    open_transport,
)
from tests.brokers.common import (
    Ledger,
    Proxy,
    drop_store_table,
    free_port,
    holder_fails,
    key_held,
    pg_store,
    remove_destinations,
    running,
    unique,
    wait_until,
    with_port,
)
from tests.services import REDIS_URL, require

Mode = Literal["two_phase", "transactional"]
T = TypeVar("T", bound=Transport)
MS = timedelta(milliseconds=1)
SECOND = timedelta(seconds=1)

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=200 * MS,
    backoff=Backoff(first=50 * MS, most=200 * MS),
    max_deliveries=3,
    poll=200 * MS,
    reconnect=Backoff(first=100 * MS, most=500 * MS),
    shutdown_grace=timedelta(seconds=10),
)
"""Short delays, so the scenarios run in seconds (never asserted as times)."""


def body(key: str, **fields: object) -> bytes:
    """A message's JSON body: ``{"k": key, ...}`` (the ledger row's key is ``k``)."""
    return json.dumps({"k": key, **fields}).encode()


def total(*consumers: BrokerConsumer) -> Counter[str]:
    """The outcome counts of several consumers added up."""
    counts: Counter[str] = Counter()
    for each in consumers:
        counts.update(each.counts)
    return counts


@dataclass(frozen=True)
class DeadCopy:
    """A message as the dead-letter destination holds it, read back with a plain client: the
    producer's id, the body, the content type, and every header (or stream field) besides; the
    ``x-oncely-*`` ones say why it is there."""

    message_id: str | None
    body: bytes
    headers: Mapping[str, Any]
    content_type: str | None

    @property
    def outcome(self) -> str | None:
        return self.headers.get("x-oncely-outcome")

    @property
    def reason(self) -> str:
        return str(self.headers.get("x-oncely-reason", ""))

    @property
    def consumer(self) -> str | None:
        return self.headers.get("x-oncely-consumer")

    @property
    def deliveries(self) -> str | None:
        return self.headers.get("x-oncely-deliveries")


class Watched:
    """A transport that notes every delivery it hands out: (message id, delivery count), and
    every error a fetch raised."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.seen: list[tuple[str | None, int | None]] = []
        self.failures: list[Exception] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        return await self._fetched(self.inner.fetch, limit, timeout)

    async def fetch_batch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        return await self._fetched(
            getattr(self.inner, "fetch_batch", self.inner.fetch), limit, timeout
        )

    async def _fetched(
        self, fetch: Callable[[int, timedelta], Awaitable[list[Delivery]]], *args: Any
    ) -> list[Delivery]:
        try:
            return self._saw(await fetch(*args))
        except Exception as exc:
            self.failures.append(exc)
            raise

    def _saw(self, found: list[Delivery]) -> list[Delivery]:
        self.seen.extend((d.envelope.message_id, d.delivery_count) for d in found)
        return found

    def counts(self, message_id: str) -> list[int | None]:
        """The broker's delivery count of each delivery of ``message_id``, in order."""
        return [count for seen, count in self.seen if seen == message_id]

    def as_transport(self) -> Transport:
        return cast(Transport, self)


async def fetch_one(transport: Transport, *, tries: int = 100) -> Delivery:
    """The next delivery, riding out a connection that is still coming back."""
    for _ in range(tries):
        with contextlib.suppress(oncely.BrokerUnavailable):
            found = await transport.fetch(1, 200 * MS)
            if found:
                return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no delivery came")


class BrokerSuite:
    """The shared behaviours. A subclass sets ``url`` and ``producer_class``, implements the
    methods below that raise ``NotImplementedError`` and overrides the others where its broker
    says more; pytest makes one instance per test, and ``_one_test`` gives it a fresh
    ``source`` (queue, stream or subject) and ``ledger``."""

    url: ClassVar[str]
    producer_class: ClassVar[Callable[..., Producer]]
    group: ClassVar[str] = "billing"
    """The consumer group and inbox consumer name (recorded on dead-letter copies)."""
    consumer_makes_its_source_again: ClassVar[bool] = True
    """False where a consumer waits for its deleted source to be created again rather than
    create it itself (SQS: a queue made by the consumer would lack the operator's
    attributes); the source deleted mid-run is then made again by the test, as an operator
    would, once the consumer has met its absence."""
    retries_reach_the_consumer: ClassVar[bool] = True
    """False where the broker itself drops a producer retry (JetStream's duplicate window)."""
    redelivers_on_connection_loss: ClassVar[bool] = False
    shared_url_options: ClassVar[str] = ""
    """URL options (``a=1&b=2``) both the consumer and the producer read."""
    consumer_url_options: ClassVar[str] = ""
    """URL options only the consumer reads, which the producer refuses as the consumer's;
    empty where the producer reads every option the consumer does (RabbitMQ)."""
    producer_url_options: ClassVar[str] = ""
    """URL options only the producer reads, which the consumer refuses as the producer's."""
    """True where a lost connection gives its unacknowledged deliveries back at once
    (RabbitMQ); elsewhere a delivery waits for its ack wait and is extended meanwhile."""

    source: str
    ledger: Ledger

    # ------------------------------------------------------------------ per broker

    def require(self) -> None:
        """Skip (or, in CI, fail) unless the broker answers."""
        raise NotImplementedError

    def new_source(self) -> str:
        """A queue, stream or subject name no other test uses."""
        raise NotImplementedError

    def transport(self, *, url: str | None = None, **options: Any) -> Transport:
        """A transport reading this test's source (at ``url``, default the test broker's),
        closed after the test. ``ack_wait`` and ``connect_timeout`` are understood by all."""
        raise NotImplementedError

    async def publish_raw_without_id(self, payload: bytes) -> None:
        """Publish ``payload`` (content type JSON) with no message id at all."""
        raise NotImplementedError

    async def dead_letters(self) -> list[DeadCopy]:
        """Every message in the dead-letter destination (RabbitMQ: taken out of it)."""
        raise NotImplementedError

    async def unsettled(self) -> int | None:
        """How many messages of the source the broker holds unacknowledged: not yet
        delivered, or delivered and neither acknowledged nor dead-lettered; ``None`` while the
        broker cannot say (RabbitMQ, with a consumer holding messages)."""
        raise NotImplementedError

    async def consumers_reading(self) -> int:
        """How many consumers are reading the source now."""
        raise NotImplementedError

    async def deliveries_made(self) -> int | None:
        """How many deliveries the broker has made in all, where it says (None)."""
        return None

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        """The broker's own per-delivery fields of a first delivery and its redelivery."""

    async def settled(self) -> bool:
        """Once the test's consumers are gone: nothing unacknowledged, nothing unread."""
        return await self.unsettled() == 0

    async def delete_source(self) -> None:
        """Delete the source from the broker as an operator would (the queue, the stream
        key, the stream), and with it what a consumer had set up there."""
        pytest.skip(f"{type(self).__name__} does not delete its source mid-run")

    async def make_source_again(self) -> None:
        """Create the deleted source again, as an operator would (where the consumer does
        not: ``consumer_makes_its_source_again``)."""
        raise NotImplementedError

    async def source_gone_noticed(self, watched: Watched) -> bool:
        """Whether the consumer reading through ``watched`` has met its deleted source (where
        it waits for it: ``consumer_makes_its_source_again``); by default, two fetches failed."""
        return len(watched.failures) >= 2

    async def reading_again(self) -> bool:
        """Whether the consumer reads the source again after it was deleted."""
        return await self._reading(1)

    async def remove(self) -> None:
        """Delete what the test made on the broker."""
        await remove_destinations(self.url, self.source)

    # ------------------------------------------------------------------ shared plumbing

    @pytest.fixture(autouse=True)
    async def _one_test(self, ledger: Ledger) -> AsyncIterator[None]:
        require("Redis", REDIS_URL, 6379)  # the two-phase inbox's store
        self.require()
        self.ledger = ledger
        self.source = self.new_source()
        self._cleanups: list[Callable[[], Awaitable[object]]] = []
        self._producer: Producer | None = None
        try:
            yield
        finally:
            for cleanup in reversed(self._cleanups):
                with contextlib.suppress(Exception):
                    await cleanup()
            await self.remove()

    def after(self, cleanup: Callable[[], Awaitable[object]]) -> None:
        """Run ``cleanup`` after the test (last registered, first run)."""
        self._cleanups.append(cleanup)

    def closed_after(self, made: T) -> T:
        """``made``, closed after the test (closing twice is harmless)."""
        self.after(made.close)
        return made

    def proxy(self) -> contextlib.AbstractAsyncContextManager[Proxy]:
        """A relay in front of the broker (:class:`~tests.brokers.common.Proxy`): clients
        given its ``url`` can have their connections cut."""
        return Proxy(self.url)

    def settings(self, **overrides: Any) -> ConsumerSettings:
        return dataclasses.replace(FAST, **overrides)

    def producer(self, *, url: str | None = None, **options: Any) -> Producer:
        made = self.producer_class(url or self.url, self.source, **options)
        self.after(made.close)
        return made

    async def publish(
        self,
        key: str,
        *,
        message_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
        **fields: object,
    ) -> None:
        """Publish ``body(key, **fields)`` with ``message_id`` (default: ``key``)."""
        if self._producer is None:
            self._producer = self.producer()
        await self._producer.publish(
            body(key, **fields),
            message_id=message_id or key,
            headers=headers,
            correlation_id=correlation_id,
        )

    def inboxes(
        self, mode: Mode, n: int, *, retention: oncely.Retention | None = None
    ) -> list[oncely.AsyncInbox]:
        """``n`` inboxes on one marker table (transactional) or key prefix (two-phase), each
        with connections of its own, as ``n`` consumer processes would have."""
        where = unique("inbox")
        if mode == "transactional":
            self.after(lambda: asyncio.to_thread(drop_store_table, where))
            made = [
                oncely.AsyncInbox(pg_store(where), consumer=self.group, retention=retention)
                for _ in range(n)
            ]
        else:
            self.after(lambda: _drop_redis_prefix(where))
            made = [
                oncely.AsyncInbox(
                    oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={where}"),
                    consumer=self.group,
                    lease=oncely.Lease(duration=SECOND),
                    retention=retention,
                )
                for _ in range(n)
            ]
        for inbox in made:  # closed before its store (cleanups run last first)
            self.after(inbox.store.aclose)
            self.after(inbox.aclose)
        return made

    def inbox_named(self, consumer: str) -> oncely.AsyncInbox:
        """An in-memory inbox whose consumer name is not the transport's group: what the
        dead-letter copies' ``x-oncely-consumer`` must say, wherever the copy is written."""
        assert consumer != self.group
        return oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer=consumer)

    def consumer(
        self,
        handler: Callable[..., Awaitable[Any]],
        *,
        mode: Mode = "two_phase",
        inbox: oncely.AsyncInbox | None = None,
        transport: Transport | Watched | None = None,
        key: oncely.KeySource | None = None,
        **settings: Any,
    ) -> BrokerConsumer:
        """A consumer of this test's source (its own inbox unless one is given)."""
        if isinstance(transport, Watched):
            transport = transport.as_transport()
        return BrokerConsumer(
            transport or self.transport(),
            inbox or self.inboxes(mode, 1)[0],
            handler,
            mode=mode,
            key=key,
            settings=self.settings(**settings),
        )

    async def apply(self, payload: dict[str, Any]) -> None:
        """The two-phase effect: one ledger row."""
        await self.ledger.apply(payload["k"], payload)

    async def apply_in(self, tx: Any, payload: dict[str, Any]) -> None:
        """The transactional effect: one ledger row in the marker's transaction."""
        await self.ledger.apply_in(tx, payload["k"], payload)

    async def assert_settled(self) -> None:
        if not await self.settled():
            found = await self.unsettled()
            pytest.fail(f"messages were left on the broker (unacknowledged): {found}")

    async def assert_unsettled(self, n: int) -> None:
        """The broker holds ``n`` messages of the source unacknowledged (where it can say)."""
        found = await self.unsettled()
        assert found is None or found == n, f"the broker holds {found} messages, not {n}"

    async def _reading(self, n: int) -> bool:
        return await self.consumers_reading() == n

    # ------------------------------------------------------------------ a. producer retries

    async def test_r1_r2_producer_retries_are_duplicates_and_all_acked(self) -> None:
        """Five messages, each published three times with the same id (a producer retrying):
        one effect each, every copy acknowledged. Where the broker drops a retry itself
        (JetStream's duplicate window) the inbox sees one copy: the window is a complement to
        the inbox, never a replacement (R14)."""
        keys = [f"m{n}" for n in range(5)]
        for _attempt in range(3):
            for key in keys:
                await self.publish(key)
        copies = 15 if self.retries_reach_the_consumer else 5
        worker = self.consumer(self.apply_in, mode="transactional")
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] + worker.counts["duplicate"] == copies,
                what=f"all {copies} copies to be settled",
            )
        assert self.ledger.counts() == dict.fromkeys(keys, 1)
        assert worker.counts == Counter({"processed": 5, "duplicate": copies - 5})
        assert await self.dead_letters() == []
        await self.assert_settled()

    async def test_r1_one_producer_publishing_150_messages_at_once_sends_every_one(
        self,
    ) -> None:
        """An application that publishes from many tasks at once through one producer (a web
        server's requests, a ``gather``): 150 publishes in flight together each land, none
        refused for want of a connection, and a consumer applies each once."""
        keys = [f"c{n}" for n in range(150)]
        producer = self.producer()
        await asyncio.gather(
            *(producer.publish(body(key), message_id=key) for key in keys)
        )  # fmt: skip
        worker = self.consumer(self.apply_in, mode="transactional")
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] == len(keys),
                what="every message published at once to be processed",
            )
        assert self.ledger.counts() == dict.fromkeys(keys, 1)
        await self.assert_settled()

    async def test_a_source_deleted_mid_run_is_made_again_and_read(self) -> None:
        """An operator deletes the queue or stream a consumer is reading (a reset): the
        consumer notices (RabbitMQ cancels it and leaves its channel open; a JetStream pull
        on a deleted consumer looks like an empty one; Redis ends a blocked read with an
        error), sets up what it reads again and reads what is published there next. It
        neither stops nor waits for good, looking healthy, while messages pile up. Where the
        consumer does not make its source itself it meets the deletion (SQS: as an outage,
        BrokerUnavailable from its fetch; Kafka: the topic's id missing), rides it out and
        reads the source once an operator has made it again."""
        await self.publish("before")
        watched = Watched(self.transport())
        worker = self.consumer(self.apply, transport=watched)
        async with running(worker) as task:
            await wait_until(lambda: worker.counts["processed"] == 1, what="the first message")
            await self.delete_source()
            if not self.consumer_makes_its_source_again:
                await wait_until(
                    lambda: task.done() or self.source_gone_noticed(watched),
                    what="the consumer to meet the deleted source",
                )
                assert not task.done(), f"the consumer stopped: {task.exception()!r}"
                assert all(isinstance(e, oncely.BrokerUnavailable) for e in watched.failures)
                await self.make_source_again()
            await wait_until(
                lambda: task.done() or self.reading_again(),
                timeout=timedelta(seconds=30),
                what="the consumer to read the source again",
            )
            assert not task.done(), f"the consumer stopped: {task.exception()!r}"
            await self.producer().publish(body("after"), message_id="after")
            await wait_until(
                lambda: worker.counts["processed"] == 2, what="the message published after"
            )
        assert self.ledger.counts() == {"before": 1, "after": 1}
        await self.assert_settled()

    # ------------------------------------------------------------------ d. dead letters

    async def test_r2_r4_r20_conflicts_poison_undecodable_and_idless_are_dead_lettered(
        self,
    ) -> None:
        """A reused id with other content and a reused CloudEvent under a new id are key
        conflicts (R20 step 6); a handler's ``Reject``, a body that is not JSON and a message
        with no id at all are rejected (R2-R4). Each copy keeps its id, body and headers and
        says why it is there."""

        async def handler(tx: Any, payload: dict[str, Any]) -> None:
            if payload.get("poison"):
                raise oncely.Reject("poison pill: no such account")
            await self.apply_in(tx, payload)

        ce = cloudevent_headers(source="/shop", event_type="order.paid", event_id="e1")
        worker = self.consumer(
            handler,
            mode="transactional",
            key=oncely.FirstOf(oncely.CloudEventsKey(), oncely.MessageIdKey()),
        )
        async with running(worker):
            await self.publish("pay", amount=10)
            await self.publish("e1", message_id="m-e1", headers=ce, total=10)
            await wait_until(lambda: len(self.ledger.counts()) == 2, what="the first two")
            await self.publish("pay", amount=99, headers={"x-app": "billing"})
            await self.publish("e1", message_id="m-e1-again", headers=ce, total=99)
            await self.publish("bad", poison=True, headers={"tenant": "t1"})
            assert self._producer is not None
            await self._producer.publish(b"{not json", message_id="garbled")
            await self.publish_raw_without_id(body("anon"))
            await wait_until(
                lambda: worker.counts["key_conflict"] + worker.counts["rejected"] == 5,
                what="five dead letters",
            )
        copies = await self.dead_letters()
        by_key = {_key_of(copy.body): copy for copy in copies}
        assert len(copies) == 5
        assert set(by_key) == {"pay", "e1", "bad", "garbled", "anon"}
        for copy in copies:
            assert copy.consumer == self.group
            assert copy.deliveries == "1"
            assert copy.reason
        for key, sent in (("pay", "pay"), ("e1", "m-e1-again"), ("bad", "bad"), ("garbled",) * 2):
            assert by_key[key].message_id == sent
            assert by_key[key].content_type == "application/json"
        conflict = by_key["pay"]
        assert conflict.outcome == "key_conflict"
        assert json.loads(conflict.body) == {"k": "pay", "amount": 99}
        assert conflict.headers["x-app"] == "billing"  # the original's headers travel along
        event = by_key["e1"]
        assert event.outcome == "key_conflict"
        assert event.headers["ce-id"] == "e1"
        assert json.loads(event.body)["total"] == 99
        poison = by_key["bad"]
        assert poison.outcome == "rejected"
        assert "poison pill: no such account" in poison.reason
        assert poison.headers["tenant"] == "t1"
        garbled = by_key["garbled"]
        assert garbled.outcome == "rejected"
        assert "undecodable body" in garbled.reason
        assert garbled.body == b"{not json"
        anonymous = by_key["anon"]
        assert anonymous.message_id is None  # never an id the producer did not set
        assert anonymous.outcome == "rejected"
        assert "message id" in anonymous.reason
        assert json.loads(anonymous.body) == {"k": "anon"}
        assert self.ledger.counts() == {"pay": 1, "e1": 1}
        assert worker.counts == Counter({"processed": 2, "key_conflict": 2, "rejected": 3})
        await self.assert_settled()

    # ------------------------------------------------------------------ d. retention (R13)

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        """What the transport, once open, must report about this test broker (without
        ``source``)."""
        raise NotImplementedError

    async def test_r13_a_retention_below_the_derived_horizon_refuses_to_start(self) -> None:
        """1,000 deliveries with a backoff up to an hour: no 2-minute retention covers that.
        The consumer refuses at start, names the numbers, and takes no message."""
        await self.publish("order-1")
        transport = self.transport()
        short = oncely.Retention(keep=timedelta(minutes=2))
        consumer = self.consumer(
            self.apply,
            inbox=self.inboxes("two_phase", 1, retention=short)[0],
            transport=transport,
            max_deliveries=1000,
            backoff=Backoff(first=SECOND, most=timedelta(hours=1)),
        )
        with pytest.raises(oncely.RetentionTooShort) as refused:
            await asyncio.wait_for(consumer.run(), 30)
        limits = getattr(transport, "limits", None)
        assert isinstance(limits, BrokerLimits) and limits.source
        assert dataclasses.replace(limits, source="") == self.expected_limits(transport)
        horizon = consumer.settings.horizon(limits)
        assert consumer.horizon == horizon
        deliveries = min(1000, limits.max_deliveries or 1000)
        assert horizon.max_deliveries == deliveries
        assert horizon.lock == limits.ack_wait
        assert horizon.redelivery_delay == timedelta(hours=1)
        assert str(refused.value) == (
            f"retention 2m is below the redelivery horizon of this consumer on "
            f"{transport.name} {oncely.format_duration(horizon.total)} ({horizon.explain()}); "
            "raise the inbox's Retention(keep=...), or lower max_deliveries, the backoff, the "
            "ack wait or ConsumerSettings.resubmit_window"
        )
        assert f"lock={oncely.format_duration(limits.ack_wait or timedelta(0))}" in str(
            refused.value
        )
        assert consumer.counts == Counter()  # nothing was read, nothing settled
        assert self.ledger.counts() == {}
        await self.assert_unsettled(1)

    async def test_r13_a_covering_retention_starts_and_logs_its_horizon(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        await self.publish("order-1")
        consumer = self.consumer(self.apply, resubmit_window=timedelta(hours=6))
        with caplog.at_level("INFO", logger="oncely.broker"):
            async with running(consumer):
                await wait_until(lambda: consumer.counts["processed"] == 1)
        horizon = consumer.horizon
        assert horizon.resubmit_window == timedelta(hours=6)
        lines = [r.getMessage() for r in caplog.records if "redelivery horizon" in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"redelivery horizon {oncely.format_duration(horizon.total)} = " in lines[0]
        assert "retention 7d covers it" in lines[0]
        assert self.ledger.counts() == {"order-1": 1}

    # ------------------------------------------------------------------ e. failing handlers

    async def test_r13_failing_handler_is_retried_up_to_max_deliveries_then_dead_lettered(
        self,
    ) -> None:
        """A handler that always fails is run ``max_deliveries`` times (the broker's delivery
        count rising 1, 2, 3), then dead-lettered with the last error; one that fails once is
        retried and applied once."""
        attempts = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            key = payload["k"]
            attempts[key] += 1
            if key == "always" or (key == "once" and attempts[key] == 1):
                raise RuntimeError(f"boom {attempts[key]} for {key}")
            await self.apply(payload)

        await self.publish("always")
        await self.publish("once")
        watched = Watched(self.transport())
        worker = self.consumer(handler, transport=watched, max_deliveries=3)
        async with running(worker):
            await wait_until(
                lambda: (
                    worker.counts["dead_lettered_after_retries"] == 1
                    and worker.counts["processed"] == 1
                ),
                what="the failing message dead-lettered and the flaky one applied",
            )
        assert attempts == {"always": 3, "once": 2}
        assert watched.counts("always") == [1, 2, 3]
        assert watched.counts("once") == [1, 2]
        assert self.ledger.counts() == {"once": 1}
        (copy,) = await self.dead_letters()
        assert copy.message_id == "always"
        assert json.loads(copy.body) == {"k": "always"}
        assert copy.outcome == "rejected"
        assert "failed on all 3 deliveries" in copy.reason
        assert "boom 3 for always" in copy.reason  # the last error
        assert copy.deliveries == "3"
        assert copy.consumer == self.group
        assert worker.counts == Counter(
            {"failed": 4, "processed": 1, "dead_lettered_after_retries": 1}
        )
        await self.assert_settled()

    async def test_r8_r13_give_backs_are_not_failures_max_deliveries_counts_failed_runs(
        self,
    ) -> None:
        """A copy meets the key held by another worker (a live lease, renewed) and is given
        back at least 3 times, each a delivery the broker counts; then that worker fails and
        releases the key, and every run of the copy fails (the first on the delivery that
        was held when the key was released). ``max_deliveries`` (3) counts the failed runs,
        not the give-backs: the copy runs 3 times, then it is dead-lettered with the true
        number of failures (before, the broker's count, 5 or more at the first run,
        dead-lettered it after a single failure, as "failed on all 5 deliveries")."""
        (inbox,) = self.inboxes("two_phase", 1)
        runs = 0

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal runs
            runs += 1
            raise RuntimeError(f"boom {runs}")

        watched = Watched(self.transport())
        worker = self.consumer(handler, inbox=inbox, transport=watched, max_deliveries=3)
        async with key_held(inbox, "contended", then=holder_fails) as holder:
            await self.publish("contended")
            async with running(worker):
                await wait_until(lambda: worker.counts["in_flight"] >= 4, what="4 in_flight")
                holder.release()
                assert (await holder.task).outcome is oncely.Outcome.FAILED
                await wait_until(
                    lambda: worker.counts["dead_lettered_after_retries"] == 1,
                    timeout=timedelta(seconds=30),
                    what="the failing copy dead-lettered",
                )
        in_flight = worker.counts["in_flight"]
        # The copy held when the key was released ran there (unless it was released in the
        # moment between a give-back and the next delivery): one give-back fewer.
        given_back = len(watched.counts("contended")) - 3
        assert given_back in (in_flight - 1, in_flight), (given_back, in_flight)
        assert runs == 3
        assert worker.counts == Counter(
            {"in_flight": in_flight, "failed": 3, "dead_lettered_after_retries": 1}
        )
        assert self.ledger.counts() == {}
        (copy,) = await self.dead_letters()
        assert copy.message_id == "contended"
        assert copy.outcome == "rejected"
        assert "boom 3" in copy.reason  # the last error
        if getattr(watched.inner, "local_delivery_counts", False):
            # A count of the consumer's own (Kafka) counts runs only.
            assert "failed on all 3 deliveries" in copy.reason, copy.reason
            assert copy.deliveries == "3"
        else:  # the broker counted every delivery; the copy tells them apart
            deliveries = given_back + 3
            assert f"failed 3 times in {deliveries} deliveries ({given_back} given back unrun" in (
                copy.reason
            ), copy.reason
            assert copy.deliveries == str(deliveries)
        await self.assert_settled()

    async def check_a_handler_raising_cancelled_error_is_a_failure(self) -> None:
        """A handler that raises CancelledError itself (a cancellation of its own tasks or
        timeouts that escaped it), while nobody cancelled the consumer: a failure, retried
        up to ``max_deliveries`` and dead-lettered with the reason, never given back at once
        and uncounted, round after round, as a shutdown's message is. (Called by the
        brokers whose consumers read one message at a time by default.)"""
        runs = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            runs[payload["k"]] += 1
            if payload["k"] == "cancels":
                raise asyncio.CancelledError
            await self.apply(payload)

        await self.publish("cancels")
        await self.publish("fine")
        worker = self.consumer(handler, max_deliveries=3)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["dead_lettered_after_retries"] == 1,
                timeout=timedelta(seconds=20),
                what="the message whose handler raises CancelledError to be dead-lettered",
            )
        assert runs == {"cancels": 3, "fine": 1}
        assert self.ledger.counts() == {"fine": 1}
        (copy,) = await self.dead_letters()
        assert copy.message_id == "cancels"
        assert "failed on all 3 deliveries" in copy.reason
        assert "raised CancelledError" in copy.reason
        await self.assert_settled()

    # ------------------------------------------------------------------ g. in_flight

    async def test_r8_r10_in_flight_copy_is_requeued_not_acked_while_another_holds_the_claim(
        self,
    ) -> None:
        """Another worker holds the claim (a live lease, renewed): the consumer's copy is
        answered ``in_flight``, held while what is left of that lease runs out (at least
        ``requeue_delay``) and then given back, again and again, never acknowledged (a
        broker's delivery count rising each time; Kafka's, the consumer's own, counting runs
        only); once the holder has finished, the copy held then is a ``duplicate`` and
        acknowledged."""
        (inbox,) = self.inboxes("two_phase", 1)
        watched = Watched(self.transport())
        worker = self.consumer(self.apply, inbox=inbox, transport=watched)
        async with key_held(inbox, "held", then=self.apply) as holder:
            await self.publish("held")
            async with running(worker):
                await wait_until(lambda: worker.counts["in_flight"] >= 4, what="4 in_flight")
                await self.assert_unsettled(1)  # still on the broker, unacknowledged
                assert self.ledger.counts() == {}
                holder.release()
                assert (await holder.task).outcome is oncely.Outcome.PROCESSED
                await wait_until(lambda: worker.counts["duplicate"] == 1, what="the duplicate")
        in_flight = worker.counts["in_flight"]
        # The copy held when the holder finished is resolved where it waits (unless that was
        # in the moment between a give-back and the next delivery: one delivery more).
        deliveries = len(watched.counts("held"))
        assert deliveries in (in_flight, in_flight + 1), (deliveries, in_flight)
        if getattr(watched.inner, "local_delivery_counts", False):
            # A count of the consumer's own (Kafka) counts runs: a copy given back unrun is
            # not one, so a later failure of it is not taken for its last delivery.
            assert watched.counts("held") == [1] * deliveries
        else:  # the broker counts every delivery
            assert watched.counts("held") == list(range(1, deliveries + 1))
        assert worker.counts == Counter({"in_flight": in_flight, "duplicate": 1})
        assert self.ledger.counts() == {"held": 1}
        await self.assert_settled()

    async def test_r8_r10_a_copy_waits_out_a_dead_workers_lease_instead_of_spending_deliveries(
        self,
    ) -> None:
        """A worker died holding the key (its 3 s lease is not renewed). Before, the copy was
        given back every ``requeue_delay`` (here 0.1 s) while the lease ran out, a delivery
        spent each time: with the defaults (a 30 s lease, 1 s, a RabbitMQ delivery limit of 20)
        the broker dead-lettered the message, with no reason, before the key was free. Now
        each give-back waits for what is left of the lease: a few deliveries, then it runs."""
        (inbox,) = self.inboxes("two_phase", 1)
        dead = oncely.AsyncInbox(
            inbox.store,
            consumer=self.group,
            lease=oncely.Lease(duration=timedelta(seconds=3), heartbeat=False),
        )
        held = await dead.claim("orphan", json.loads(body("orphan")))
        assert held.won
        worker = self.consumer(self.apply, inbox=inbox, requeue_delay=timedelta(seconds=0.1))
        await self.publish("orphan")
        async with running(worker):
            await wait_until(lambda: worker.counts["stale_reclaimed"] == 1, what="the takeover")
        assert worker.counts["in_flight"] <= 3, worker.counts
        assert self.ledger.counts() == {"orphan": 1}
        assert await self.dead_letters() == []
        await self.assert_settled()

    async def _claimed_by_hand(
        self, inbox: oncely.AsyncInbox, key: str
    ) -> oncely.AsyncClaimed[Any]:
        """Another worker's claim of ``key`` on ``inbox``'s records, taken by hand under a
        two-minute lease (not renewed, and not lapsing within the test): its copy on the
        broker meets a key held for far longer than the test waits."""
        other = oncely.AsyncInbox(
            inbox.store,
            consumer=self.group,
            lease=oncely.Lease(duration=timedelta(minutes=2), heartbeat=False),
        )
        held = await other.claim(key, json.loads(body(key)))
        assert held.won
        return held

    async def test_r8_r10_a_held_copy_is_acked_as_a_duplicate_once_the_holder_completes(
        self,
    ) -> None:
        """Another worker holds the key under a two-minute lease: the copy is ``in_flight``
        and held by the consumer, unacknowledged, while it watches the key's record. Once
        the holder completes, the copy goes through the inbox again on the same delivery: a
        ``duplicate``, acknowledged, its handler never run, no delivery spent. Before, it
        waited for all that was left of the lease (two minutes) before it was given back and
        found a duplicate: the wait below gives up long before that (R8, R10)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "held")
        runs = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            runs[payload["k"]] += 1
            await self.apply(payload)

        watched = Watched(self.transport())
        worker = self.consumer(handler, inbox=inbox, transport=watched)
        await self.publish("held")
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] == 1, what="the copy in_flight")
            await self.assert_unsettled(1)  # held, unacknowledged
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
            await wait_until(
                lambda: worker.counts["duplicate"] == 1,
                timeout=timedelta(seconds=30),
                what="the held copy acknowledged as a duplicate",
            )
        assert runs == {}
        assert worker.counts == Counter({"in_flight": 1, "duplicate": 1})
        assert len(watched.counts("held")) == 1  # one delivery: never given back
        assert self.ledger.counts() == {}
        assert await self.dead_letters() == []
        await self.assert_settled()

    async def test_r8_r10_a_held_copy_runs_once_when_the_holder_releases(self) -> None:
        """Another worker holds the key under a two-minute lease and then gives it up (its
        claim released, as a failed handler's is): the copy held meanwhile goes through the
        inbox again at once, claims the key and runs its handler, once (R8, R10)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "freed")
        runs = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            runs[payload["k"]] += 1
            await self.apply(payload)

        watched = Watched(self.transport())
        worker = self.consumer(handler, inbox=inbox, transport=watched)
        await self.publish("freed")
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] == 1, what="the copy in_flight")
            assert (await held.release()).outcome is oncely.Outcome.FAILED
            await wait_until(
                lambda: worker.counts["processed"] == 1,
                timeout=timedelta(seconds=30),
                what="the held copy run once the key was released",
            )
        assert runs == {"freed": 1}
        assert worker.counts == Counter({"in_flight": 1, "processed": 1})
        assert len(watched.counts("freed")) == 1
        assert self.ledger.counts() == {"freed": 1}
        assert await self.dead_letters() == []
        await self.assert_settled()

    async def test_r8_r10_a_stop_gives_a_held_copy_back_at_once_for_the_next_consumer(
        self,
    ) -> None:
        """A consumer holding an ``in_flight`` copy (its key held under a two-minute lease)
        is stopped: the stop waits for no lease, whatever its ``shutdown_grace`` (ten
        minutes here), and the copy is given back at once, unacknowledged. The next
        consumer gets it, holds it in turn, and acknowledges it as a ``duplicate`` once the
        holder completes (R8, R10)."""
        (inbox,) = self.inboxes("two_phase", 1)
        held = await self._claimed_by_hand(inbox, "handed")
        runs = Counter[str]()

        async def handler(payload: dict[str, Any]) -> None:
            runs[payload["k"]] += 1
            await self.apply(payload)

        first = self.consumer(handler, inbox=inbox, shutdown_grace=timedelta(minutes=10))
        await self.publish("handed")
        task = asyncio.create_task(first.run())
        try:
            await wait_until(lambda: first.counts["in_flight"] == 1, what="the copy in_flight")
            first.stop()
            await wait_until(task.done, timeout=timedelta(seconds=30), what="the stop")
        finally:
            first.stop()
            await asyncio.wait_for(task, 60)
        # (Read again as it stopped, the copy is given back at once again.)
        assert set(first.counts) == {"in_flight"}, first.counts
        second = self.consumer(handler, inbox=inbox)
        async with running(second):
            await wait_until(lambda: second.counts["in_flight"] == 1, what="the copy again")
            assert (await held.complete(None)).outcome is oncely.Outcome.PROCESSED
            await wait_until(
                lambda: second.counts["duplicate"] == 1,
                timeout=timedelta(seconds=30),
                what="the copy acknowledged as a duplicate by the next consumer",
            )
        assert runs == {}
        assert second.counts == Counter({"in_flight": 1, "duplicate": 1})
        assert self.ledger.counts() == {}
        assert await self.dead_letters() == []
        await self.assert_settled()

    # ------------------------------------------------------------------ c. two consumers

    @pytest.mark.parametrize("mode", ["transactional", "two_phase"])
    async def test_r3_r8_two_consumers_receiving_copies_at_once_apply_once(
        self, mode: Mode
    ) -> None:
        """Two relays publish each event under their own message ids (the same CloudEvents
        source and id), and one of them retries with its id; two consumers with inboxes of
        their own on one marker table or key prefix, as two processes would have, get the
        copies at the same time. The marker is the arbiter (R8): one effect per event, every
        other copy a ``duplicate``; in two-phase mode a copy met while the other runs is
        ``in_flight`` first. (JetStream's duplicate window drops the retry itself.)"""

        async def slow_in(tx: Any, payload: dict[str, Any]) -> None:
            await self.apply_in(tx, payload)
            await asyncio.sleep(0.3)  # the transaction stays open: the other copy waits

        async def slow(payload: dict[str, Any]) -> None:
            await asyncio.sleep(0.3)
            await self.apply(payload)

        handler = slow_in if mode == "transactional" else slow
        # One message at a time (batch=1): in a batch, a copy of a message the same batch
        # holds is settled as its duplicate at once (the contract suite shows it), so copies
        # meeting each other show as in_flight only between separate deliveries.
        workers = [
            self.consumer(
                handler,
                mode=mode,
                inbox=inbox,
                key=oncely.CloudEventsKey(),
                concurrency=2,
                batch=1,
            )
            for inbox in self.inboxes(mode, 2)
        ]
        events = [f"evt-{n}" for n in range(4)]
        copies = len(events) * (3 if self.retries_reach_the_consumer else 2)
        async with running(workers[0]), running(workers[1]):
            await wait_until(lambda: self._reading(2), what="both consumers reading")
            for event in events:
                ce = cloudevent_headers(source="/relay", event_type="order", event_id=event)
                for relay in ("a", "b", "a"):
                    await self.publish(event, message_id=f"{relay}-{event}", headers=ce)
            await wait_until(
                lambda: total(*workers)["processed"] + total(*workers)["duplicate"] == copies,
                what=f"all {copies} copies to be settled",
            )
        assert self.ledger.counts() == dict.fromkeys(events, 1)
        counts = total(*workers)
        in_flight = counts.pop("in_flight", 0)
        assert counts == Counter({"processed": len(events), "duplicate": copies - len(events)})
        if mode == "two_phase":
            assert in_flight >= 1  # copies really were handled at the same time
        else:
            assert in_flight == 0  # a transaction waits for the other's commit instead
        assert all(sum(worker.counts.values()) >= 1 for worker in workers)
        await self.assert_settled()

    # ------------------------------------------------------------------ b. slow handlers

    async def test_r10_a_handler_slower_than_the_ack_wait_is_kept_alive_and_delivered_once(
        self,
    ) -> None:
        """An ack wait of 1 s and handlers of 2.5 s: the running handler's delivery is
        extended (JetStream ``+WPI``, Redis idle time reset; RabbitMQ holds a delivery for its
        live consumer anyway), so the second consumer never gets it: one delivery each."""

        async def slow(payload: dict[str, Any]) -> None:
            await asyncio.sleep(2.5)
            await self.apply(payload)

        for key in ("slow-1", "slow-2"):
            await self.publish(key)
        (inbox,) = self.inboxes("two_phase", 1)
        watched = [Watched(self.transport(ack_wait=SECOND)) for _ in range(2)]
        workers = [self.consumer(slow, inbox=inbox, transport=each) for each in watched]
        async with running(workers[0]), running(workers[1]):
            await wait_until(lambda: len(self.ledger.counts()) == 2, what="both slow messages")
        assert self.ledger.counts() == {"slow-1": 1, "slow-2": 1}
        assert total(*workers) == Counter({"processed": 2})  # no redelivery at all
        assert sorted(watched[0].seen + watched[1].seen) == [("slow-1", 1), ("slow-2", 1)]
        made = await self.deliveries_made()
        assert made is None or made == 2
        await self.assert_settled()

    # ------------------------------------------------------------------ graceful stop

    async def _stop_while_running(
        self, keys: list[str], inbox: oncely.AsyncInbox, concurrency: int
    ) -> tuple[BrokerConsumer, list[str]]:
        """Publish ``keys``, start a consumer whose handlers wait, ask it to stop once every
        slot is busy, then let the handlers finish: the consumer and the keys it started."""
        release = asyncio.Event()
        started: list[str] = []

        async def held(tx: Any, payload: dict[str, Any]) -> None:
            started.append(payload["k"])
            await release.wait()
            await self.apply_in(tx, payload)

        for key in keys:
            await self.publish(key)
        worker = self.consumer(held, mode="transactional", inbox=inbox, concurrency=concurrency)
        task = asyncio.create_task(worker.run())
        try:
            await wait_until(lambda: len(started) == concurrency, what="every slot busy")
            worker.stop()
            await asyncio.sleep(0.5)
            assert not task.done()  # waiting for the running handlers
            release.set()
            await asyncio.wait_for(task, 30)
        finally:
            release.set()
            worker.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 30)
        return worker, started

    async def test_r7_graceful_stop_finishes_running_handlers_and_loses_nothing(self) -> None:
        """``stop()`` while every handler slot is busy: the consumer returns only once the
        running handlers have finished and their messages are acknowledged (after the
        transport stopped reading); the messages it never took stay on the broker for the
        next consumer, which applies them and meets no copy of the others."""
        keys = [f"s{n}" for n in range(5)]
        first_inbox, second_inbox = self.inboxes("transactional", 2)
        first, started = await self._stop_while_running(keys, first_inbox, 2)
        done = len(started)
        assert first.counts["processed"] == done
        # A batch consumer may have read more than it started: given back, never started.
        assert set(first.counts) <= {"processed", "in_flight"}
        assert self.ledger.counts() == dict.fromkeys(started, 1)
        await self.assert_unsettled(len(keys) - done)
        second = self.consumer(self.apply_in, mode="transactional", inbox=second_inbox)
        async with running(second):
            await wait_until(
                lambda: second.counts["processed"] == len(keys) - done, what="the rest"
            )
        assert second.counts == Counter({"processed": len(keys) - done})
        assert self.ledger.counts() == dict.fromkeys(keys, 1)
        await self.assert_settled()

    async def test_r7_stop_takes_no_new_message_once_asked(self) -> None:
        """Once ``stop()`` is asked, no message is taken any more: only the handlers already
        running finish."""
        (inbox,) = self.inboxes("transactional", 1)
        worker, started = await self._stop_while_running(["t0", "t1"], inbox, 1)
        assert len(started) == 1 and worker.counts["processed"] == 1
        # A batch consumer may have read the other with the first: given back, never started.
        assert set(worker.counts) <= {"processed", "in_flight"}

    # ------------------------------------------------------------------ the URL options

    async def test_a_consumers_url_copied_to_the_producer_is_told_its_consumer_options(
        self,
    ) -> None:
        """A user who gives the producer the consumer's URL is told which of its options are
        the consumer's and to remove them, not that they are unknown: the producer does not
        use them, and taking them silently would let a user believe it did (a topic's
        partitions, a queue created, an ack wait). The options both read are taken: the
        producer made with them publishes, and the message is read (R2)."""
        shared = _with_query(self.url, self.shared_url_options)
        consumers = _with_query(shared, self.consumer_url_options)
        self.closed_after(open_transport(consumers, self.source, group=self.group))
        if self.consumer_url_options:
            with pytest.raises(oncely.ConfigurationError) as refused:
                open_producer(consumers, self.source)
            said = str(refused.value)
            assert ("a consumer option" in said) or ("consumer options" in said), said
            assert "the producer does not use" in said and "remove" in said, said
            for name in parse_qs(self.consumer_url_options):
                assert repr(name) in said, said
        if self.producer_url_options:  # and the other way round
            producers = _with_query(shared, self.producer_url_options)
            with pytest.raises(oncely.ConfigurationError) as refused:
                open_transport(producers, self.source, group=self.group)
            said = str(refused.value)
            assert "producer option" in said and "the consumer does not use" in said, said
            for name in parse_qs(self.producer_url_options):
                assert repr(name) in said, said
            self.after(open_producer(producers, self.source).close)
        producer = open_producer(shared, self.source)
        self.after(producer.close)
        await producer.publish(body("copied"), message_id="copied")
        worker = self.consumer(self.apply)
        async with running(worker):
            await wait_until(lambda: worker.counts["processed"] == 1, what="the message")
        assert self.ledger.counts() == {"copied": 1}
        await self.assert_settled()

    # ------------------------------------------------------------------ the envelope

    async def test_r2_r4_envelope_carries_the_producers_id_and_headers_never_delivery_data(
        self,
    ) -> None:
        """The producer's id, correlation id, headers and CloudEvents attributes reach the
        envelope; per-delivery data (delivery tag, entry id, sequence, delivery count) stays
        in ``Envelope.transport``, which no key source reads (R4). A message given back
        comes again with its delivery count raised."""
        ce = cloudevent_headers(source="/orders", event_type="order.placed", event_id="o-1")
        sent = {**ce, "tenant": "t1"}
        await self.publish("one", message_id="m-1", headers=sent, correlation_id="c-9")
        await self.publish("two", message_id="m-2", headers=sent)
        made = self.transport()
        await made.open(4)
        got: list[Delivery] = []
        while len(got) < 2:
            got.append(await fetch_one(made))
        first, second = sorted(got, key=lambda d: d.envelope.message_id or "")
        for delivery, key in ((first, "one"), (second, "two")):
            env = delivery.envelope
            assert json.loads(env.body) == {"k": key}
            assert env.delivery_count == delivery.delivery_count == 1
            assert env.headers.items() >= sent.items()
            assert set(delivery.describe()).isdisjoint(env.headers)
            assert env.transport["content_type"] == "application/json"
            assert env.transport["redelivered"] is False
            assert oncely.CloudEventsKey()(env) == "/orders o-1"
            assert oncely.HeaderKey("tenant")(env) == "t1"
        assert oncely.MessageIdKey()(first.envelope) == "m-1"
        assert first.envelope.correlation_id == "c-9"
        assert second.envelope.correlation_id is None
        await first.retry(timedelta(0))
        again = await fetch_one(made)
        assert again.envelope.message_id == "m-1"
        assert again.delivery_count == again.envelope.delivery_count == 2
        assert again.envelope.transport["redelivered"] is True
        assert set(again.describe()).isdisjoint(again.envelope.headers)
        self.check_transport_fields(first, again)
        await again.ack()
        await second.ack()
        await made.close()
        await self.assert_settled()

    # ------------------------------------------------------------------ faults

    async def test_unreachable_broker_is_broker_unavailable(self) -> None:
        """Nothing listens at the address: opening the transport and publishing raise
        BrokerUnavailable (never a raw client error), within the connect timeout."""
        url = with_port(self.url, free_port())
        made = self.transport(url=url, connect_timeout=2 * SECOND)
        with pytest.raises(oncely.BrokerUnavailable):
            await made.open(1)
        producer = self.producer(url=url, connect_timeout=2 * SECOND)
        with pytest.raises(oncely.BrokerUnavailable):
            await producer.publish(b"{}", message_id="m")

    async def test_settling_on_a_lost_connection_raises_broker_unavailable_and_it_comes_back(
        self,
    ) -> None:
        """The connection drops with a delivery held: an empty fetch had returned []; now
        fetch and ack raise BrokerUnavailable (never a raw client error, never a silent
        buffer); once the broker can be reached again the message comes back, delivered
        again, and is acknowledged."""
        async with self.proxy() as proxy:
            made = self.transport(url=proxy.url, ack_wait=SECOND)
            await made.open(1)
            assert await made.fetch(1, 300 * MS) == []
            await self.publish("x")
            held = await fetch_one(made)
            assert held.envelope.message_id == "x" and held.delivery_count == 1
            proxy.refusing = True
            assert proxy.cut() >= 1
            with pytest.raises(oncely.BrokerUnavailable):
                for _ in range(100):  # until the transport notices the loss
                    await made.fetch(1, 100 * MS)
            with pytest.raises(oncely.BrokerUnavailable):
                await held.ack()
            proxy.refusing = False
            again = await fetch_one(made)
            assert again.envelope.message_id == "x"
            assert (again.delivery_count or 0) >= 2
            await again.ack()
            await made.close()
        await self.assert_settled()

    async def test_r8_r10_connection_cut_under_a_slow_handler_applies_once(self) -> None:
        """The consumer's connection is cut while a handler runs longer than its lease: the
        consumer reconnects by itself and the handler's effect is applied once. Where the
        broker gives the delivery back at once (RabbitMQ), the copy meets the live, renewed
        claim and is requeued as ``in_flight``, the first handler's ack then fails on the dead
        channel, and the next copy is a ``duplicate``."""
        started, release = asyncio.Event(), asyncio.Event()
        calls = Counter[str]()

        async def slow(payload: dict[str, Any]) -> None:
            calls[payload["k"]] += 1
            started.set()
            await release.wait()
            await self.apply(payload)

        async with self.proxy() as proxy:
            worker = self.consumer(slow, transport=self.transport(url=proxy.url))
            try:
                async with running(worker) as task:
                    await self.publish("slow")
                    await asyncio.wait_for(started.wait(), 30)
                    connected = proxy.accepted
                    assert proxy.cut() >= 1
                    await wait_until(lambda: proxy.accepted > connected, what="a reconnection")
                    if self.redelivers_on_connection_loss:
                        # Requeued at least 6 times, 0.2 s apart: it outlived its 1 s lease.
                        await wait_until(
                            lambda: worker.counts["in_flight"] >= 6,
                            what="the redelivered copy to be requeued as in_flight",
                        )
                    assert self.ledger.counts() == {}
                    release.set()
                    await wait_until(lambda: worker.counts["processed"] == 1, what="the effect")
                    if self.redelivers_on_connection_loss:
                        await wait_until(
                            lambda: worker.counts["duplicate"] >= 1, what="the copy a duplicate"
                        )
                    assert not task.done()  # the same consumer rode the cut out
            finally:
                release.set()
        assert self.ledger.counts() == {"slow": 1}
        assert calls == {"slow": 1}
        assert worker.counts["processed"] == 1
        if self.redelivers_on_connection_loss:
            assert worker.counts["settle_failed"] >= 1  # the stale delivery's ack
        assert await self.dead_letters() == []
        await self.assert_settled()

    async def test_r16_each_line_has_the_correlation_id_and_the_key_as_the_inbox_shows_it(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """R16: the consumer's line for each message carries its correlation id, and shows
        its key as the inbox's own lines do: with ``log_keys="hash"`` (a key that is personal
        data) no line says the key itself. A message given back because the store failed
        (it has no outcome) is logged with its key and correlation id too."""
        where = unique("inbox")
        self.after(lambda: _drop_redis_prefix(where))
        async with Proxy(f"{REDIS_URL}?prefix={where}") as relay:
            store = oncely.AsyncRedisStore.from_url(relay.url)
            self.after(store.aclose)
            inbox = oncely.AsyncInbox(store, consumer=self.group, log_keys="hash")
            self.after(inbox.aclose)
            worker = self.consumer(self.apply, inbox=inbox)
            with caplog.at_level("INFO", logger="oncely"):
                async with running(worker):
                    await self.publish("alice@example.com", correlation_id="corr-1")
                    await wait_until(lambda: worker.counts["processed"] == 1, what="the first")
                    relay.refusing = True
                    relay.cut()
                    await self.publish("bob@example.com", correlation_id="corr-2")
                    await wait_until(
                        lambda: worker.counts["store_unavailable"] >= 1, what="the outage"
                    )
                    relay.refusing = False
                    await wait_until(lambda: worker.counts["processed"] == 2, what="the second")
        ours = [r for r in caplog.records if r.name.startswith("oncely")]
        for record in ours:
            fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
            assert "@example.com" not in record.getMessage() + str(fields), record.getMessage()
        alice, bob = (key_for_logs(k, "hash") for k in ("alice@example.com", "bob@example.com"))
        consumer_lines = [r for r in ours if r.name == "oncely.broker"]
        named = {
            (key, getattr(r, "oncely_outcome", "store_unavailable"), correlation_id)
            for r in consumer_lines
            for key, correlation_id in zip(
                getattr(r, "oncely_keys", [getattr(r, "oncely_key", None)]),
                getattr(r, "oncely_correlation_ids", [getattr(r, "oncely_correlation_id", None)]),
                strict=True,
            )
        }
        assert (alice, "processed", "corr-1") in named
        assert (bob, "store_unavailable", "corr-2") in named
        assert (bob, "processed", "corr-2") in named
        assert self.ledger.counts() == {"alice@example.com": 1, "bob@example.com": 1}
        await self.assert_settled()

    async def test_r16_a_store_error_that_names_the_key_shows_it_hashed(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """R16 with ``log_keys="hash"``: a store error whose text names the key (here the
        claim that kept changing hands: a rival takes the lapsed claim over each time the
        reconciler is asked, for real, on Redis) reaches the consumer's line of a message
        given back with the key hashed in it, never as it is; the message runs once the
        rival stops."""
        key = "dana@example.com"
        where = unique("inbox")
        self.after(lambda: _drop_redis_prefix(where))
        store = oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={where}")
        self.after(store.aclose)
        worker: BrokerConsumer | None = None
        rivals = 0

        async def rival_takes_over(stale: oncely.StaleClaim) -> oncely.Resolution:
            nonlocal rivals
            if worker is None or worker.counts["store_unavailable"] == 0:
                rivals += 1
                taken = await store.takeover(self.group, key, expected_token=stale.record.token,
                                             fingerprint=None, token=f"rival-{rivals}",
                                             lease_ms=1, keep_ms=60_000)  # fmt: skip
                assert taken.won
                await asyncio.sleep(0.01)  # the rival's lease lapses in turn
            return oncely.Resolution.retry()

        inbox = oncely.AsyncInbox(
            store,
            consumer=self.group,
            log_keys="hash",
            on_stale=rival_takes_over,
            lease=oncely.Lease(duration=SECOND),
        )
        self.after(inbox.aclose)
        dead = await store.claim(self.group, key, fingerprint=None, token="dead", lease_ms=1,
                                 keep_ms=60_000, takeover=False)  # fmt: skip
        assert dead.won
        await asyncio.sleep(0.01)
        worker = self.consumer(self.apply, inbox=inbox)
        with caplog.at_level("INFO", logger="oncely"):
            async with running(worker):
                await self.publish(key, correlation_id="corr-d")
                await wait_until(lambda: worker.counts["stale_reclaimed"] == 1, what="the message")
        assert worker.counts["store_unavailable"] >= 1 and rivals >= 1
        ours = [r for r in caplog.records if r.name.startswith("oncely")]
        for record in ours:
            fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
            assert "@example.com" not in record.getMessage() + str(fields), record.getMessage()
        hashed = repr(key_for_logs(key, "hash"))
        given_back = [r for r in ours if "kept changing hands" in r.getMessage()]
        assert given_back and all(hashed in r.getMessage() for r in given_back)
        assert self.ledger.counts() == {key: 1}
        await self.assert_settled()

    async def test_r16_a_lease_lost_to_another_worker_is_logged_with_the_key_hashed(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """R10, R16 with ``log_keys="hash"``: a handler stalls past its lease (it blocks the
        event loop, so no heartbeat renews it), another worker takes the key over and
        completes it; the heartbeat's next renewal finds the lease lost, a real
        :class:`~oncely.LeaseLost`, and its line shows the key hashed, as every other line
        of the consumer does."""
        key = "erin@example.com"
        where = unique("inbox")
        self.after(lambda: _drop_redis_prefix(where))
        url = f"{REDIS_URL}?prefix={where}"
        store = oncely.AsyncRedisStore.from_url(url)
        self.after(store.aclose)
        inbox = oncely.AsyncInbox(
            store, consumer=self.group, log_keys="hash", lease=oncely.Lease(duration=SECOND)
        )
        self.after(inbox.aclose)

        def lost_lines() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "lease lost" in r.getMessage()]

        async def stalls(payload: dict[str, Any]) -> None:
            held = await store.get(self.group, key)
            assert held is not None
            rival = oncely.RedisStore.from_url(url)  # another worker, on its own connection
            try:
                while True:  # blocks the loop: the lease lapses, unrenewed
                    taken = rival.takeover(self.group, key, expected_token=held.token,
                                           fingerprint=held.fingerprint, token="rival",
                                           lease_ms=60_000, keep_ms=60_000)  # fmt: skip
                    if taken.won:
                        break
                    time.sleep(0.05)
                rival.complete(self.group, key, token="rival", result=None, keep_ms=60_000)
            finally:
                rival.close()
            await wait_until(lambda: bool(lost_lines()), what="the heartbeat's renewal")
            await self.apply(payload)

        worker = self.consumer(stalls, inbox=inbox)
        with caplog.at_level("INFO", logger="oncely"):
            async with running(worker):
                await self.publish(key, correlation_id="corr-e")
                await wait_until(lambda: worker.counts["duplicate"] == 1, what="the redelivery")
        assert worker.counts["in_flight"] >= 1
        ours = [r for r in caplog.records if r.name.startswith("oncely")]
        for record in ours:
            fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
            assert "@example.com" not in record.getMessage() + str(fields), record.getMessage()
        hashed = key_for_logs(key, "hash")
        assert hashed is not None and all(hashed in r.getMessage() for r in lost_lines())
        await self.assert_settled()


def _key_of(payload: bytes) -> str:
    """A dead-letter copy's key: its body's ``k``, or ``garbled`` for the body that is not
    JSON."""
    try:
        return str(json.loads(payload)["k"])
    except ValueError:
        return "garbled"


async def _drop_redis_prefix(prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        async for name in client.scan_iter(match=f"{prefix}*"):
            await client.unlink(name)
    finally:
        await client.aclose()


def _with_query(url: str, options: str) -> str:
    """``url`` with the query ``options`` (``a=1&b=2``) added to its own."""
    if not options:
        return url
    return f"{url}{'&' if '?' in url else '?'}{options}"
