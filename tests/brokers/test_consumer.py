"""The consumer loop shared by every adapter, on the in-memory broker of ``oncely.testing``:
each outcome becomes exactly its broker action (ARCHITECTURE: adapters decide nothing), bad
input is dead-lettered with a reason and never dropped, concurrency is bounded, and a stop is
graceful. The real brokers run the same loop in test_rabbitmq/test_redis_streams/test_nats.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sqlite3
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    DeadLetter,
    Delivery,
    InboxProcessor,
    key_source,
)
from oncely.errors import ConfigurationError, SchemaMissing, StoreUnavailable
from oncely.keys import Envelope
from oncely.testing import MemoryBroker

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=timedelta(milliseconds=20),
    backoff=Backoff(first=timedelta(milliseconds=5), most=timedelta(milliseconds=20)),
    max_deliveries=3,
    poll=timedelta(milliseconds=20),
    shutdown_grace=timedelta(seconds=5),
)


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


class Effects:
    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()

    async def apply(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.applied[str(payload["order"])] += 1
        return {"ok": payload["order"]}


@pytest.fixture
def inbox() -> oncely.AsyncInbox:
    return oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="orders")


async def test_copies_of_one_message_apply_once_and_are_all_acked(inbox: oncely.AsyncInbox) -> None:
    # R1, R2: a producer retry is the same message id; the second copy is a duplicate.
    broker, effects = MemoryBroker(), Effects()
    for _ in range(3):
        broker.publish(body(order=1), message_id="order-1")
    broker.publish(body(order=2), message_id="order-2")
    consumer = BrokerConsumer(broker, inbox, effects.apply, settings=FAST)
    await broker.run_until_idle(consumer)
    assert effects.applied == {"1": 1, "2": 1}
    assert broker.acked == 4 and not broker.dead and broker.outstanding == 0
    assert consumer.counts == {"processed": 2, "duplicate": 2}


async def test_bad_messages_are_dead_lettered_with_their_reason(inbox: oncely.AsyncInbox) -> None:
    broker, effects = MemoryBroker(), Effects()
    broker.publish(body(order=1), message_id="order-1")
    broker.publish(body(order=1, amount=99), message_id="order-1")  # R20 step 6: reused id
    broker.publish(body(order=3))  # no message id (R2-R4): never processed unprotected
    broker.publish(b"{not json", message_id="order-4")
    consumer = BrokerConsumer(broker, inbox, effects.apply, settings=FAST)
    await broker.run_until_idle(consumer)
    assert effects.applied == {"1": 1}
    dead = {(d.message_id, d.why.outcome): d for d in broker.dead}
    assert set(dead) == {("order-1", "key_conflict"), (None, "rejected"), ("order-4", "rejected")}
    assert "different content" in dead["order-1", "key_conflict"].why.reason
    assert "message id" in dead[None, "rejected"].why.reason
    assert "undecodable body" in dead["order-4", "rejected"].why.reason
    for message in broker.dead:
        assert message.headers["x-oncely-outcome"] == message.why.outcome
        assert message.headers["x-oncely-reason"] == message.why.reason
        assert message.headers["x-oncely-consumer"] == "orders"
    assert broker.outstanding == 0


async def test_r16_a_cloudevent_whose_data_cannot_be_read_is_logged_with_its_key(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With the payload read from a CloudEvent (``--payload data``), an event whose data
    cannot be read is rejected and dead-lettered, and its lines name its key (R16), as every
    other rejected message's do."""
    from oncely.cloudevents import event_data

    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="orders")
    broker, effects = MemoryBroker(), Effects()
    event = {"specversion": "1.0", "id": "e-1", "source": "/shop", "type": "order.paid"}
    sent = json.dumps({**event, "data_base64": "not base64!"}).encode()
    broker.publish(sent, content_type="application/cloudevents+json")
    processor = InboxProcessor(
        inbox, effects.apply, key=oncely.CloudEventsKey(), payload=event_data
    )
    consumer = BrokerConsumer(broker, processor, settings=FAST)
    with caplog.at_level(logging.INFO, logger="oncely"):
        await broker.run_until_idle(consumer)
    await store.aclose()
    assert consumer.counts == {"rejected": 1} and len(broker.dead) == 1
    structured = {"content_type": "application/cloudevents+json"}
    key = oncely.CloudEventsKey()(Envelope(body=sent, transport=structured))
    lines = [r for r in caplog.records if getattr(r, "oncely_outcome", None) == "rejected"]
    assert {r.name for r in lines} == {"oncely", "oncely.broker"}
    assert all(getattr(r, "oncely_key", None) == key for r in lines), key


async def test_a_rejected_poison_message_is_dead_lettered_and_stays_rejected(
    inbox: oncely.AsyncInbox,
) -> None:
    broker, calls = MemoryBroker(), Counter[str]()

    async def poison(payload: dict[str, Any]) -> None:
        calls["poison"] += 1
        raise oncely.Reject("amount must be positive")

    broker.publish(body(order=1, amount=-5), message_id="order-1")
    broker.publish(body(order=1, amount=-5), message_id="order-1")
    await broker.run_until_idle(BrokerConsumer(broker, inbox, poison, settings=FAST))
    assert calls["poison"] == 1  # the redelivery is rejected without running the handler again
    assert [d.why.outcome for d in broker.dead] == ["rejected", "rejected"]
    assert all("amount must be positive" in d.why.reason for d in broker.dead)


async def test_a_failing_handler_is_retried_then_dead_lettered_after_max_deliveries(
    inbox: oncely.AsyncInbox,
) -> None:
    broker, attempts = MemoryBroker(), Counter[str]()

    async def flaky(payload: dict[str, Any]) -> str:
        attempts[payload["kind"]] += 1
        if payload["kind"] == "broken" or attempts[payload["kind"]] == 1:
            raise ConnectionError("payment gateway timed out")
        return "charged"

    broker.publish(body(kind="broken"), message_id="m-broken")
    broker.publish(body(kind="flaky"), message_id="m-flaky")
    consumer = BrokerConsumer(broker, inbox, flaky, settings=FAST)
    await broker.run_until_idle(consumer)
    assert attempts == {"broken": 3, "flaky": 2}  # max_deliveries=3; flaky succeeds on its 2nd
    assert broker.acked == 1 and broker.retried == 3
    (dead,) = broker.dead
    assert dead.message_id == "m-broken" and dead.why.deliveries == 3
    assert dead.why.reason.startswith("failed on all 3 deliveries")
    assert "payment gateway timed out" in dead.why.reason
    assert (await inbox.get("m-flaky")) is not None


async def test_r16_hooks_hear_the_rejection_of_a_message_dead_lettered_after_its_retries() -> None:
    """The hooks get each delivery's ``failed``, then the message's end as its dead letter
    says it (``rejected``, ``dead_letter``, the reason with the deliveries): before, a metric
    counting dead letters from hooks never saw this one."""
    heard: list[oncely.Handled[Any]] = []
    inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="orders", hooks=[heard.append])
    broker = MemoryBroker()

    async def broken(payload: dict[str, Any]) -> None:
        raise ConnectionError("payment gateway timed out")

    broker.publish(body(kind="broken"), message_id="m-broken")
    await broker.run_until_idle(BrokerConsumer(broker, inbox, broken, settings=FAST))
    assert [h.outcome for h in heard] == [oncely.Outcome.FAILED] * 3 + [oncely.Outcome.REJECTED]
    end = heard[-1]
    assert end.action is oncely.Action.DEAD_LETTER and end.key == "m-broken"
    assert end.consumer == "orders" and end.attempt == heard[-2].attempt
    assert end.reason is not None and end.reason.startswith("failed on all 3 deliveries")
    (dead,) = broker.dead
    assert dead.why.reason == end.reason


class CopiesFail(MemoryBroker):
    """A memory broker whose first ``failures`` dead-letter copies are not written (as a Kafka
    copy that times out during a broker restart): the message is given back instead."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        return [_CopyMayFail(d, self) for d in await super().fetch(limit, timeout)]


class _CopyMayFail:
    def __init__(self, inner: Delivery, broker: CopiesFail) -> None:
        self._inner, self._broker = inner, broker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def dead_letter(self, why: DeadLetter) -> None:
        if self._broker.failures:
            self._broker.failures -= 1
            await self._inner.retry(timedelta(0))  # not copied: handed out again
            raise oncely.BrokerUnavailable("the dead-letter copy was not confirmed in time")
        await self._inner.dead_letter(why)


async def test_r13_a_dead_letter_that_was_not_written_is_not_counted_as_dead_lettered(
    inbox: oncely.AsyncInbox,
) -> None:
    """A handler failing on every delivery, max_deliveries=3: the first two dead-letter copies
    fail (the message is given back, read again, fails again), the third is written. The
    counts say what happened: one dead letter after retries, two copies that failed, and
    the broker holds one dead message."""
    broker, attempts = CopiesFail(failures=2), Counter[str]()

    async def broken(payload: dict[str, Any]) -> None:
        attempts["broken"] += 1
        raise ConnectionError("payment gateway timed out")

    broker.publish(body(kind="broken"), message_id="m-broken")
    consumer = BrokerConsumer(broker, inbox, broken, settings=FAST)
    await broker.run_until_idle(consumer)
    assert len(broker.dead) == 1 and broker.outstanding == 0
    assert attempts == {"broken": 5}  # 3 deliveries, then one more for each failed copy
    assert consumer.counts["dead_lettered_after_retries"] == 1
    assert consumer.counts["dead_letter_failed"] == 2
    assert consumer.counts["failed"] == 5


async def test_in_flight_is_given_back_later_and_never_acked(inbox: oncely.AsyncInbox) -> None:
    # Another worker holds a live claim: the copy must wait, and be answered as a duplicate
    # once the other worker completes (R8, R10).
    broker, effects = MemoryBroker(), Effects()
    started, release = asyncio.Event(), asyncio.Event()

    async def other_worker(payload: dict[str, Any]) -> dict[str, Any]:
        started.set()
        await release.wait()
        return await effects.apply(payload)

    holder = asyncio.create_task(inbox.handle("order-1", {"order": 1}, other_worker))
    await started.wait()
    broker.publish(body(order=1), message_id="order-1")
    consumer = BrokerConsumer(broker, inbox, effects.apply, settings=FAST)
    run = asyncio.create_task(broker.run_until_idle(consumer))
    while broker.retried < 2:
        await asyncio.sleep(0.01)
    assert broker.acked == 0  # in_flight is never acknowledged
    release.set()
    await holder
    await run
    assert effects.applied == {"1": 1}
    assert consumer.counts["in_flight"] >= 2 and consumer.counts["duplicate"] == 1
    assert broker.acked == 1


class FlakyStore(oncely.AsyncMemoryStore):
    """A store that is down for its first ``down`` claims, as a store restarting is."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down = down

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            self.down -= 1
            raise StoreUnavailable("connection refused")
        return await super().claim(*args, **kwargs)


async def test_a_store_outage_gives_the_message_back_and_the_loop_keeps_going() -> None:
    broker, effects = MemoryBroker(), Effects()
    inbox = oncely.AsyncInbox(FlakyStore(down=2), consumer="orders")
    broker.publish(body(order=1), message_id="order-1")
    consumer = BrokerConsumer(broker, inbox, effects.apply, settings=FAST)
    await broker.run_until_idle(consumer)
    assert effects.applied == {"1": 1}
    assert consumer.counts["store_unavailable"] == 2 and broker.retried == 2
    assert broker.acked == 1 and not broker.dead


async def test_no_more_handlers_run_at_once_than_the_concurrency(inbox: oncely.AsyncInbox) -> None:
    broker = MemoryBroker()
    running = peak = 0

    async def slow(payload: dict[str, Any]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    for n in range(40):
        broker.publish(body(order=n), message_id=f"order-{n}")
    await broker.run_until_idle(BrokerConsumer(broker, inbox, slow, settings=FAST))
    assert peak == FAST.concurrency
    assert broker.acked == 40


async def test_a_long_handler_extends_its_delivery(inbox: oncely.AsyncInbox) -> None:
    broker = MemoryBroker(extend_every=timedelta(milliseconds=10))

    async def long(payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.1)

    broker.publish(body(order=1), message_id="order-1")
    await broker.run_until_idle(BrokerConsumer(broker, inbox, long, settings=FAST))
    assert broker.extended >= 3 and broker.acked == 1


async def test_stop_lets_running_handlers_finish_and_acks_them(inbox: oncely.AsyncInbox) -> None:
    broker, effects = MemoryBroker(), Effects()
    entered = asyncio.Event()

    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        await asyncio.sleep(0.2)
        return await effects.apply(payload)

    broker.publish(body(order=1), message_id="order-1")
    consumer = BrokerConsumer(broker, inbox, slow, settings=FAST)
    task = asyncio.create_task(consumer.run())
    await entered.wait()
    consumer.stop()
    await task
    assert effects.applied == {"1": 1} and broker.acked == 1 and broker.outstanding == 0


@pytest.mark.parametrize("concurrency", [16, 1], ids=["a-free-slot", "every-slot-busy"])
async def test_past_the_grace_a_handler_is_cancelled_and_its_message_given_back(
    inbox: oncely.AsyncInbox, concurrency: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Every slot busy: before, the reading loop waited for a slot to free before it saw the
    # stop, so the grace only started once a handler finished (here: never).
    broker, effects = MemoryBroker(), Effects()
    entered = asyncio.Event()

    async def stuck(payload: dict[str, Any]) -> None:
        entered.set()
        await asyncio.sleep(3600)

    broker.publish(body(order=1), message_id="order-1")
    grace = ConsumerSettings(
        shutdown_grace=timedelta(milliseconds=50), poll=FAST.poll, concurrency=concurrency
    )
    consumer = BrokerConsumer(broker, inbox, stuck, settings=grace)
    task = asyncio.create_task(consumer.run())
    await entered.wait()
    caplog.set_level(logging.INFO, logger="oncely.broker")
    consumer.stop()
    await asyncio.wait_for(task, 60)  # (a guard against a hang, not a timing)
    assert broker.acked == 0 and broker.outstanding == 1  # given back, not lost
    # Said in the log (before, a cut-off handler left no trace and the stop read "idle").
    said = [r.getMessage() for r in caplog.records if r.name == "oncely.broker"]
    assert any("stopping: waiting up to 0.05s for 1 running" in line for line in said), said
    assert any("shutdown grace of 0.05s ran out: 1 handler task(s) cancelled" in line
               for line in said), said  # fmt: skip
    record = await inbox.get("order-1")
    assert record is None or record.status is not oncely.Status.COMPLETED  # claim released
    # The next consumer processes it (the released claim does not make it a duplicate).
    await broker.run_until_idle(BrokerConsumer(broker, inbox, effects.apply, settings=FAST))
    assert effects.applied == {"1": 1} and broker.acked == 1


def test_transactional_mode_needs_a_transactional_store(inbox: oncely.AsyncInbox) -> None:
    async def book(tx: object, payload: object) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError, match="cannot join a transaction"):
        BrokerConsumer(MemoryBroker(), inbox, book, mode="transactional")


async def test_a_handler_whose_arguments_cannot_fit_the_mode_is_refused_when_built(
    tmp_path: Any,
) -> None:
    """A one-argument handler in the transactional mode (which calls ``handler(tx, payload)``)
    used to start, then fail every message with a TypeError and dead-letter it. It is refused
    when the consumer is built; only a call certain to fail is: a partial, a bound method, a
    callable object, ``*args`` and a decorator's wrapper are read as they would be called."""
    store = oncely.AsyncSQLiteStore(str(tmp_path / "inbox.db"))
    inbox = oncely.AsyncInbox(store, consumer="ledger")

    async def charge(payload: object) -> None:
        raise AssertionError("never runs")

    async def book(tx: Any, payload: dict[str, Any]) -> None:
        raise AssertionError("never runs")

    async def tagged(payload: object, *, tag: str) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError) as refused:
        BrokerConsumer(MemoryBroker(), inbox, charge, mode="transactional")
    assert str(refused.value).endswith(
        "charge takes (payload), but the transactional mode calls it as "
        "handler(tx, payload): write it as async def charge(tx, payload)"
    ), refused.value
    with pytest.raises(ConfigurationError, match=r"two-phase mode calls it as handler\(payload"):
        BrokerConsumer(MemoryBroker(), inbox, book)
    with pytest.raises(ConfigurationError, match="takes"):
        InboxProcessor(inbox, tagged)  # a keyword-only argument nothing passes

    class Ledger:
        async def book(self, tx: Any, payload: object) -> None: ...

        async def __call__(self, tx: Any, payload: object) -> None: ...

    def rename(fn: Any) -> Any:
        @functools.wraps(fn)  # copies a signature the wrapper does not take
        async def wrapper(tx: Any, payload: object) -> None:
            await fn("db", tx, payload)

        return wrapper

    @rename
    async def booked(db: str, tx: Any, payload: object) -> None: ...

    async def anything(*args: object) -> None: ...

    fitting = [functools.partial(booked), Ledger().book, Ledger(), booked, anything]
    fitting += [functools.partial(lambda ledger, tx, payload: None, "main")]
    for handler in fitting:
        BrokerConsumer(MemoryBroker(), inbox, handler, mode="transactional")
    # What the check cannot read (a builtin without a signature) is left to run.
    BrokerConsumer(MemoryBroker(), inbox, print)

    # And a partial that fits runs: the check does not stand in its way.
    broker, seen = MemoryBroker(), []

    async def noted(into: list[object], tx: Any, payload: dict[str, Any]) -> None:
        into.append(payload["n"])

    broker.publish(body(n=1), message_id="m1")
    await broker.run_until_idle(
        BrokerConsumer(
            broker, inbox, functools.partial(noted, seen), mode="transactional", settings=FAST
        )
    )
    await inbox.aclose()
    await store.aclose()
    assert seen == [1] and broker.acked == 1


async def test_transactional_mode_on_sqlite_commits_marker_and_effect_together(
    tmp_path: Any,
) -> None:
    store = oncely.AsyncSQLiteStore(str(tmp_path / "inbox.db"))
    inbox = oncely.AsyncInbox(store, consumer="ledger")
    broker = MemoryBroker()

    async def book(tx: Any, payload: dict[str, Any]) -> None:
        await tx.execute("CREATE TABLE IF NOT EXISTS ledger (n INTEGER)")
        await tx.execute("INSERT INTO ledger VALUES (?)", (payload["n"],))

    for n in (1, 1, 2):
        broker.publish(body(n=n), message_id=f"m{n}")
    await broker.run_until_idle(
        BrokerConsumer(broker, inbox, book, mode="transactional", settings=FAST)
    )
    async with store.transaction() as tx:
        rows = await (await tx.execute("SELECT n FROM ledger ORDER BY n")).fetchall()
    await inbox.aclose()
    assert [row[0] for row in rows] == [1, 2]
    assert broker.acked == 3


def test_key_source_specs() -> None:
    envelope = oncely.Envelope(
        body={"order": {"id": 7}},
        message_id="m-1",
        headers={"ce-source": "/shop", "ce-id": "e-9", "Idempotency-Key": "k-3"},
    )
    assert key_source("message-id")(envelope) == "m-1"
    assert key_source("cloudevents")(envelope) == "/shop e-9"
    assert key_source("header:Idempotency-Key")(envelope) == "k-3"
    assert key_source("body:order.id")(envelope) == "7"
    assert key_source("header:missing,message-id")(envelope) == "m-1"
    for transport_id in ("delivery-tag", "entry-id", "sequence", "header:x-delivery-count"):
        with pytest.raises(ConfigurationError, match="R4"):
            key_source(transport_id)
    with pytest.raises(ConfigurationError, match="unknown key source"):
        key_source("order_id")


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ConfigurationError):
        ConsumerSettings(concurrency=0)
    with pytest.raises(ConfigurationError):
        ConsumerSettings(max_deliveries=0)
    with pytest.raises(ConfigurationError):
        Backoff(first=timedelta(seconds=5), most=timedelta(seconds=1))
    backoff = Backoff(first=timedelta(seconds=1), most=timedelta(seconds=5))
    assert [backoff.delay(n).total_seconds() for n in (1, 2, 3, 4, 9)] == [1, 2, 4, 5, 5]


# ---------------------------------------------------------------- the store, checked at start


async def test_a_store_down_at_start_stops_run_before_the_broker_is_read(tmp_path: Any) -> None:
    # A real Redis client against a loopback port nothing listens on: the store is down.
    from tests.brokers.common import free_port

    store = oncely.open_async(f"redis://127.0.0.1:{free_port()}/0")
    inbox = oncely.AsyncInbox(store, consumer="orders")
    broker, effects = MemoryBroker(), Effects()
    broker.publish(body(order=1), message_id="order-1")
    consumer = BrokerConsumer(broker, inbox, effects.apply, settings=FAST)
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1"):
        await asyncio.wait_for(consumer.run(), 30)
    # Nothing was read: the message is still the broker's, not given back once per attempt.
    assert broker.outstanding == 1 and broker.retried == 0 and broker.acked == 0
    assert not effects.applied and not consumer.counts
    await store.aclose()


async def test_the_store_schema_is_made_at_start_not_at_the_first_message(tmp_path: Any) -> None:
    path = tmp_path / "inbox.db"
    store = oncely.open_async(f"sqlite:///{path}")  # migrate=True: tables made on first use
    inbox = oncely.AsyncInbox(store, consumer="orders")
    broker = MemoryBroker()
    consumer = BrokerConsumer(broker, inbox, Effects().apply, settings=FAST)
    running = asyncio.create_task(consumer.run())
    try:
        tables: set[str] = set()
        for _ in range(500):  # the file is made first, its tables a moment later
            if path.exists():
                with contextlib.closing(sqlite3.connect(path)) as conn:
                    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
                if "oncely_inbox" in tables:
                    break
            await asyncio.sleep(0.01)
        assert "oncely_inbox" in tables, tables  # with no message read yet
    finally:
        consumer.stop()
        await running
        await store.aclose()


async def test_a_schema_this_oncely_cannot_use_stops_the_start(tmp_path: Any) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    store = oncely.open_async(f"sqlite:///{path}?migrate=false")  # no tables, none made
    broker = MemoryBroker()
    broker.publish(body(order=1), message_id="order-1")
    consumer = BrokerConsumer(
        broker, oncely.AsyncInbox(store, consumer="orders"), Effects().apply, settings=FAST
    )
    with pytest.raises(SchemaMissing, match="oncely migrate"):
        await consumer.run()
    assert broker.outstanding == 1 and broker.retried == 0
    await store.aclose()
