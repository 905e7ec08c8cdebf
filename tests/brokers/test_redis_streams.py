"""Redis Streams end to end, against a real Redis: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and nothing pending in the consumer group (XPENDING 0, lag 0).

Transactional mode runs on PostgreSQL (the effect and the marker in one transaction, R7);
two-phase mode on Redis (a claim, the handler, a completion, R10). The restart test runs its
own redis-server (append-only file on, fsync always) on a free port, so the shared server on
6379 is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

import oncely
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    DeadLetter,
    cloudevent_headers,
    open_producer,
    open_transport,
)
from oncely.brokers.redis_streams import RedisStreams, RedisStreamsProducer
from tests.brokers.common import (
    Ledger,
    drop_store_table,
    pg_store,
    require_postgres,
    running,
    unique,
    wait_until,
)
from tests.services import REDIS_URL, require

GROUP = "billing"
MS = timedelta(milliseconds=1)

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=100 * MS,
    backoff=Backoff(first=50 * MS, factor=1, most=50 * MS),
    poll=200 * MS,
    reconnect=Backoff(first=50 * MS, most=500 * MS),
    shutdown_grace=timedelta(seconds=10),
)


def settings(**changes: Any) -> ConsumerSettings:
    return dataclasses.replace(FAST, **changes)


# ---------------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def admin() -> Iterator[redis.Redis]:
    require("Redis", REDIS_URL, 6379)
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def stream(admin: redis.Redis) -> Iterator[str]:
    name = unique("rs")
    yield name
    admin.delete(name, f"{name}.dead")


@pytest.fixture
async def pg() -> AsyncIterator[oncely.AsyncPostgresStore]:
    require_postgres()
    table = unique("inbox")
    store = pg_store(table)
    yield store
    await store.aclose()
    drop_store_table(table)


@pytest.fixture
async def rstore(admin: redis.Redis) -> AsyncIterator[oncely.AsyncRedisStore]:
    prefix = unique("rsinbox")
    store = oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={prefix}")
    yield store
    await store.aclose()
    keys = list(admin.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        admin.delete(*keys)


def transport(stream: str, url: str = REDIS_URL, **options: Any) -> RedisStreams:
    options.setdefault("claim_every", 100 * MS)
    return RedisStreams(url, stream, group=GROUP, **options)


def consumer(
    stream: str,
    store: oncely.AsyncStore,
    handler: Any,
    *,
    mode: str,
    url: str = REDIS_URL,
    consumer_settings: ConsumerSettings = FAST,
    **options: Any,
) -> BrokerConsumer:
    inbox = oncely.AsyncInbox(store, consumer="billing")
    return BrokerConsumer(
        transport(stream, url, **options),
        inbox,
        handler,
        mode=mode,  # type: ignore[arg-type]
        settings=consumer_settings,
    )


async def publish(
    stream: str,
    key: str,
    body: object,
    *,
    times: int = 1,
    url: str = REDIS_URL,
    **options: Any,
) -> None:
    producer = RedisStreamsProducer(url, stream)
    raw = body if isinstance(body, bytes) else oncely_json(body)
    try:
        for _ in range(times):
            await producer.publish(raw, message_id=key, **options)
    finally:
        await producer.close()


def oncely_json(body: object) -> bytes:
    return json.dumps(body).encode()


def group_state(admin: redis.Redis, stream: str) -> tuple[int, int | None] | None:
    """(pending entries, entries not yet delivered to the group); None before the group."""
    if not admin.exists(stream):
        return None
    for info in admin.xinfo_groups(stream):
        if info["name"] == GROUP.encode():
            return int(info["pending"]), info["lag"]
    return None


def settled(admin: redis.Redis, stream: str) -> bool:
    return group_state(admin, stream) == (0, 0)


def assert_settled(admin: redis.Redis, stream: str) -> None:
    """Nothing pending, nothing unread: every entry of the stream was delivered and acked."""
    assert admin.xpending(stream, GROUP)["pending"] == 0
    assert group_state(admin, stream) == (0, 0)


def dead_letters(admin: redis.Redis, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()}
        for _id, fields in admin.xrange(f"{stream}.dead")
    ]


def total(*consumers: BrokerConsumer) -> Counter[str]:
    counts: Counter[str] = Counter()
    for each in consumers:
        counts.update(each.counts)
    return counts


def consumers_in_group(admin: redis.Redis, stream: str) -> int:
    if group_state(admin, stream) is None:
        return 0
    return len(admin.xinfo_consumers(stream, GROUP))


# ---------------------------------------------------------------------- the transport itself


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
    with pytest.raises(oncely.ConfigurationError, match="known: maxlen"):
        open_producer("redis://127.0.0.1:6379/0?ack_wait=1", "orders")
    assert first.prune_idle_consumers == timedelta(hours=1)
    never = open_transport(f"{REDIS_URL}?prune_idle_consumers=0", "orders", group=GROUP)
    assert never.prune_idle_consumers is None  # type: ignore[attr-defined]
    with pytest.raises(oncely.ConfigurationError, match="prune_idle_consumers"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, prune_idle_consumers=timedelta(0))


async def test_unreachable_redis_raises_broker_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket is closed
    dead = transport("nowhere", f"redis://127.0.0.1:{port}/0")
    with pytest.raises(oncely.BrokerUnavailable):
        await dead.open(4)
    producer = RedisStreamsProducer(f"redis://127.0.0.1:{port}/0", "nowhere")
    with pytest.raises(oncely.BrokerUnavailable):
        await producer.publish(b"{}", message_id="m")
    await producer.close()
    await dead.close()


async def test_entry_layout_keys_never_come_from_the_entry_id(
    admin: redis.Redis, stream: str
) -> None:
    producer = RedisStreamsProducer(REDIS_URL, stream)
    with pytest.raises(oncely.ConfigurationError, match="collides"):
        await producer.publish(b"{}", message_id="m", headers={"body": "x"})
    ce = cloudevent_headers(source="/orders", event_type="order.paid", event_id="e-1")
    await producer.publish(
        b'{"n": 1}', message_id="m-1", headers={**ce, "tenant": "t1"}, correlation_id="c-9"
    )
    await producer.publish(b'{"n": 1}', message_id="m-1", headers={**ce, "tenant": "t1"})
    await producer.close()
    reader = transport(stream)
    await reader.open(8)
    try:
        first, second = await reader.fetch(8, timedelta(seconds=1))
        for delivery in (first, second):
            env = delivery.envelope
            assert env.body == b'{"n": 1}'
            assert env.message_id == "m-1"
            assert env.headers == {**ce, "tenant": "t1"}
            assert env.delivery_count == delivery.delivery_count == 1
            assert env.transport["content_type"] == "application/json"
            assert env.transport["redelivered"] is False
            assert oncely.MessageIdKey()(env) == "m-1"
            assert oncely.CloudEventsKey()(env) == "/orders e-1"
            assert oncely.HeaderKey("tenant")(env) == "t1"
        # A producer retry is a new entry with a new id; the id is in the transport fields only.
        assert first.envelope.transport["entry_id"] != second.envelope.transport["entry_id"]
        assert first.envelope.correlation_id == "c-9"
        assert second.envelope.correlation_id is None
        assert group_state(admin, stream) == (2, 0)
        await first.ack()
        await second.ack()
    finally:
        await reader.close()
    assert_settled(admin, stream)
    assert consumers_in_group(admin, stream) == 0  # close left the group: it held nothing


async def test_an_entry_taken_over_is_settled_by_its_new_owner_only(
    admin: redis.Redis, stream: str
) -> None:
    """A consumer that lost an entry to XAUTOCLAIM cannot retry or dead-letter it any more;
    the delivery count rises with the takeover; the delivery limit dead-letters it."""
    await publish(stream, "m-1", {"n": 1})
    slow = transport(stream, ack_wait=200 * MS, consumer="slow")
    other = transport(stream, ack_wait=200 * MS, consumer="other")
    limited = transport(stream, ack_wait=200 * MS, consumer="limited", delivery_limit=2)
    for each in (slow, other, limited):
        await each.open(4)
    try:
        (held,) = await slow.fetch(4, timedelta(seconds=1))
        taken: list[Any] = []
        await wait_until(
            lambda: _fetch_into(other, taken), what="the other consumer to take the entry over"
        )
        (again,) = taken
        assert again.envelope.message_id == "m-1"
        assert again.delivery_count == 2
        assert again.envelope.transport["redelivered"] is True
        await held.retry(timedelta(0))  # no longer ours: left alone
        await held.dead_letter(
            DeadLetter(outcome="rejected", reason="x", consumer="c", deliveries=1)
        )
        assert admin.xlen(f"{stream}.dead") == 0
        pending = admin.xpending_range(stream, GROUP, "-", "+", 10)
        assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"other", 2)]
        # The new owner stops settling; the third delivery is over the limit of 2.
        seen: list[Any] = []

        async def limit_reached() -> bool:
            await _fetch_into(limited, seen)
            return admin.xlen(f"{stream}.dead") == 1

        await wait_until(limit_reached, what="the delivery limit to dead-letter the entry")
        assert seen == []
        (copy,) = dead_letters(admin, stream)
        assert copy["message_id"] == "m-1"
        assert copy["body"] == '{"n": 1}'
        assert copy["x-oncely-outcome"] == "rejected"
        assert "over the delivery limit of 2" in copy["x-oncely-reason"]
        assert copy["x-oncely-deliveries"] == "3"
        assert copy["x-oncely-consumer"] == "limited"
    finally:
        for each in (slow, other, limited):
            await each.close()
    assert_settled(admin, stream)


async def _fetch_into(reader: RedisStreams, into: list[Any]) -> bool:
    into.extend(await reader.fetch(4, 50 * MS))
    return bool(into)


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


def idle_consumers(admin: redis.Redis, stream: str) -> dict[str, tuple[int, int]]:
    """Each consumer of the group: (pending entries, idle milliseconds)."""
    return {
        c["name"].decode(): (int(c["pending"]), int(c["idle"]))
        for c in admin.xinfo_consumers(stream, GROUP)
    }


async def test_consumers_killed_with_sigkill_are_pruned_once_idle_and_empty(
    admin: redis.Redis, stream: str
) -> None:
    """Consumers whose process was SIGKILLed stay registered; a transport that opens deletes
    those idle past ``prune_idle_consumers`` that hold nothing, keeps one holding an entry
    until XAUTOCLAIM took the entry over, then deletes it too on a later round."""
    await publish(stream, "m-1", {"n": 1})
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _KILLED_CONSUMERS,
        REDIS_URL,
        stream,
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
        found = idle_consumers(admin, stream)
        return all(found[name][1] > limit_ms for name in ("gone", "holder"))

    await wait_until(both_idle_past_the_threshold, what="the killed consumers to be idle")
    admin.xgroup_createconsumer(stream, GROUP, "fresh")  # idle for far less than 2 s
    sweeper = transport(
        stream, consumer="sweeper", ack_wait=200 * MS, prune_idle_consumers=threshold
    )
    try:
        await sweeper.open(4)
        found = idle_consumers(admin, stream)
        assert set(found) == {"holder", "fresh", "sweeper"}  # "gone" was deleted
        assert found["holder"][0] == 1  # kept: it still holds the entry
        pending = admin.xpending_range(stream, GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"holder"]
        taken: list[Any] = []
        await wait_until(lambda: _fetch_into(sweeper, taken), what="XAUTOCLAIM to take it")
        (delivery,) = taken
        assert delivery.delivery_count == 2
        await delivery.ack()

        async def holder_pruned() -> bool:
            await sweeper.fetch(4, 50 * MS)  # housekeeping runs again while reading
            return "holder" not in idle_consumers(admin, stream)

        await wait_until(holder_pruned, what="the emptied holder to be deleted")
        assert "sweeper" in idle_consumers(admin, stream)
    finally:
        await sweeper.close()
    assert_settled(admin, stream)


# ---------------------------------------------------------------------- required scenarios


async def test_a_producer_retries_have_one_effect(
    admin: redis.Redis, stream: str, ledger: Ledger, pg: oncely.AsyncPostgresStore
) -> None:
    keys = [f"order-{i}" for i in range(5)]
    for key in keys:
        await publish(stream, key, {"k": key}, times=3)

    async def handler(tx: Any, payload: dict[str, str]) -> None:
        await ledger.apply_in(tx, payload["k"], payload)

    worker = consumer(stream, pg, handler, mode="transactional")
    async with running(worker):
        await wait_until(lambda: settled(admin, stream), what="every entry acked")
    assert ledger.counts() == dict.fromkeys(keys, 1)
    assert worker.counts["processed"] == 5
    assert worker.counts["duplicate"] == 10
    assert_settled(admin, stream)


async def test_b_handler_slower_than_ack_wait_is_not_taken_over(
    admin: redis.Redis, stream: str, ledger: Ledger, rstore: oncely.AsyncRedisStore
) -> None:
    """ack_wait 0.9 s, handlers of 2.5 s: extend() keeps the idle time low, so the second
    consumer (claiming every 0.1 s) never takes the entries over."""
    for key in ("slow-1", "slow-2"):
        await publish(stream, key, {"k": key})

    async def handler(payload: dict[str, str]) -> None:
        await asyncio.sleep(2.5)
        await ledger.apply(payload["k"], payload)

    options = {"mode": "two_phase", "ack_wait": 900 * MS}
    first = consumer(stream, rstore, handler, consumer="first", **options)
    second = consumer(stream, rstore, handler, consumer="second", **options)
    async with running(first), running(second):
        await wait_until(lambda: settled(admin, stream), what="both entries acked")
    assert ledger.counts() == {"slow-1": 1, "slow-2": 1}
    assert total(first, second) == Counter({"processed": 2})  # no redelivery at all
    assert_settled(admin, stream)


async def test_c_two_consumers_receive_copies_at_once(
    admin: redis.Redis, stream: str, ledger: Ledger, pg: oncely.AsyncPostgresStore
) -> None:
    async def handler(tx: Any, payload: dict[str, str]) -> None:
        await ledger.apply_in(tx, payload["k"], payload)
        await asyncio.sleep(0.5)  # the copy reaches the other consumer meanwhile

    one = settings(concurrency=1)
    options: dict[str, Any] = {"mode": "transactional", "consumer_settings": one}
    left = consumer(stream, pg, handler, consumer="left", **options)
    right = consumer(stream, pg, handler, consumer="right", **options)
    async with running(left), running(right):
        await wait_until(lambda: consumers_in_group(admin, stream) == 2, what="both reading")
        for key in ("twin-1", "twin-2"):
            await publish(stream, key, {"k": key}, times=2)
        await wait_until(
            lambda: settled(admin, stream) and len(ledger.counts()) == 2, what="all acked"
        )
    assert ledger.counts() == {"twin-1": 1, "twin-2": 1}
    counts = total(left, right)
    assert counts["processed"] == 2
    assert counts["duplicate"] == 2
    assert sum(left.counts.values()) >= 1
    assert sum(right.counts.values()) >= 1
    assert_settled(admin, stream)


async def test_d_conflicts_and_poison_are_dead_lettered_with_reasons(
    admin: redis.Redis, stream: str, ledger: Ledger, pg: oncely.AsyncPostgresStore
) -> None:
    async def handler(tx: Any, payload: dict[str, Any]) -> None:
        if payload.get("poison"):
            raise oncely.Reject("poison pill: no such account")
        await ledger.apply_in(tx, payload["k"], payload)

    worker = consumer(stream, pg, handler, mode="transactional")
    async with running(worker):
        await publish(stream, "pay-1", {"k": "pay-1", "amount": 10})
        await wait_until(lambda: ledger.counts() == {"pay-1": 1}, what="the first payment")
        await publish(stream, "pay-1", {"k": "pay-1", "amount": 99})  # same id, other body
        await publish(stream, "bad-1", {"k": "bad-1", "poison": True}, headers={"tenant": "t1"})
        await publish(stream, "garbled-1", b"{not json")
        admin.xadd(stream, {"body": b'{"k": "anon"}', "content_type": "application/json"})
        await wait_until(
            lambda: admin.xlen(f"{stream}.dead") == 4 and settled(admin, stream),
            what="four dead letters",
        )
    copies = dead_letters(admin, stream)
    by_id = {copy.get("message_id", "<none>"): copy for copy in copies}
    assert set(by_id) == {"pay-1", "bad-1", "garbled-1", "<none>"}
    for copy in copies:
        assert copy["x-oncely-consumer"] == "billing"
        assert copy["x-oncely-deliveries"] == "1"
        assert copy["content_type"] == "application/json"
    conflict = by_id["pay-1"]
    assert conflict["x-oncely-outcome"] == "key_conflict"
    assert '"amount": 99' in conflict["body"]
    poison = by_id["bad-1"]
    assert poison["x-oncely-outcome"] == "rejected"
    assert "poison pill" in poison["x-oncely-reason"]
    assert poison["tenant"] == "t1"
    garbled = by_id["garbled-1"]
    assert garbled["x-oncely-outcome"] == "rejected"
    assert "undecodable body" in garbled["x-oncely-reason"]
    assert garbled["body"] == "{not json"
    anonymous = by_id["<none>"]
    assert anonymous["x-oncely-outcome"] == "rejected"
    assert "message id" in anonymous["x-oncely-reason"]
    assert ledger.counts() == {"pay-1": 1}
    assert worker.counts["key_conflict"] == 1
    assert worker.counts["rejected"] == 3
    assert_settled(admin, stream)


async def test_e_failures_are_retried_then_dead_lettered(
    admin: redis.Redis, stream: str, ledger: Ledger, rstore: oncely.AsyncRedisStore
) -> None:
    attempts: Counter[str] = Counter()

    async def handler(payload: dict[str, str]) -> None:
        key = payload["k"]
        attempts[key] += 1
        if key == "always" or (key == "once" and attempts[key] == 1):
            raise RuntimeError(f"boom {attempts[key]}")
        await ledger.apply(key, payload)

    for key in ("always", "once"):
        await publish(stream, key, {"k": key})
    worker = consumer(
        stream,
        rstore,
        handler,
        mode="two_phase",
        consumer_settings=settings(max_deliveries=3),
        ack_wait=timedelta(seconds=5),
    )
    async with running(worker):
        await wait_until(
            lambda: admin.xlen(f"{stream}.dead") == 1 and settled(admin, stream),
            what="the failing message dead-lettered",
        )
    assert attempts == Counter({"always": 3, "once": 2})
    assert ledger.counts() == {"once": 1}
    (copy,) = dead_letters(admin, stream)
    assert copy["message_id"] == "always"
    assert copy["x-oncely-outcome"] == "rejected"
    assert "failed on all 3 deliveries" in copy["x-oncely-reason"]
    assert "boom 3" in copy["x-oncely-reason"]
    assert copy["x-oncely-deliveries"] == "3"
    assert worker.counts["failed"] == 4
    assert worker.counts["dead_lettered_after_retries"] == 1
    assert_settled(admin, stream)


async def test_g_in_flight_is_given_back_not_acked(
    admin: redis.Redis, stream: str, ledger: Ledger, rstore: oncely.AsyncRedisStore
) -> None:
    """While one consumer holds the claim, the other's copy is answered ``in_flight`` and
    stays pending (retried through XAUTOCLAIM, its delivery count rising), never acked."""
    gate = asyncio.Event()

    async def handler(payload: dict[str, str]) -> None:
        await gate.wait()
        await ledger.apply(payload["k"], payload)

    one = settings(concurrency=1, requeue_delay=200 * MS)
    options: dict[str, Any] = {"mode": "two_phase", "consumer_settings": one}
    left = consumer(stream, rstore, handler, consumer="left", **options)
    right = consumer(stream, rstore, handler, consumer="right", **options)
    async with running(left), running(right):
        await wait_until(lambda: consumers_in_group(admin, stream) == 2, what="both reading")
        await publish(stream, "held-1", {"k": "held-1"}, times=2)
        await wait_until(
            lambda: total(left, right)["in_flight"] >= 2, what="the copy answered in_flight twice"
        )
        pending = admin.xpending_range(stream, GROUP, "-", "+", 10)
        assert len(pending) == 2  # the one being handled and the copy given back: neither acked
        assert max(p["times_delivered"] for p in pending) >= 2  # redelivered, not acked
        assert ledger.counts() == {}
        gate.set()
        await wait_until(lambda: settled(admin, stream), what="both copies acked")
    assert ledger.counts() == {"held-1": 1}
    counts = total(left, right)
    assert (counts["processed"], counts["duplicate"]) == (1, 1)
    assert_settled(admin, stream)


async def test_cloudevents_key_across_producer_message_ids(
    admin: redis.Redis, stream: str, ledger: Ledger, rstore: oncely.AsyncRedisStore
) -> None:
    ce = cloudevent_headers(source="/shop/orders", event_type="order.paid", event_id="ev-7")
    for attempt in range(3):  # a producer that makes a new message id per attempt
        await publish(stream, f"attempt-{attempt}", {"k": "ev-7"}, headers=ce)

    async def handler(payload: dict[str, str]) -> None:
        await ledger.apply(payload["k"], payload)

    inbox = oncely.AsyncInbox(rstore, consumer="billing")
    worker = BrokerConsumer(
        transport(stream), inbox, handler, key=oncely.CloudEventsKey(), settings=FAST
    )
    async with running(worker):
        await wait_until(lambda: settled(admin, stream), what="every entry acked")
    assert ledger.counts() == {"ev-7": 1}
    assert (worker.counts["processed"], worker.counts["duplicate"]) == (1, 2)
    assert_settled(admin, stream)


# ---------------------------------------------------------------------- broker restart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(directory),
            "--logfile",
            str(directory / "redis.log"),
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


@pytest.mark.slow
async def test_f_redis_killed_and_restarted_mid_run(
    tmp_path: Path,
    ledger: Ledger,
    pg: oncely.AsyncPostgresStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    stream = unique("rs")
    server = _start_redis(port, tmp_path)
    try:
        keys = [f"m-{i}" for i in range(40)]
        for key in keys:
            await publish(stream, key, {"k": key}, url=url)

        async def handler(tx: Any, payload: dict[str, str]) -> None:
            await ledger.apply_in(tx, payload["k"], payload)
            await asyncio.sleep(0.05)

        worker = consumer(
            stream,
            pg,
            handler,
            mode="transactional",
            url=url,
            consumer_settings=settings(concurrency=2),
            ack_wait=timedelta(seconds=1),
        )
        async with running(worker) as task:
            await wait_until(lambda: len(ledger.counts()) >= 8, what="some messages processed")
            server.send_signal(signal.SIGKILL)
            server.wait()
            done_at_kill = len(ledger.counts())
            await asyncio.sleep(0.5)  # the consumer meets the dead connection
            server = _start_redis(port, tmp_path)
            later = [f"m-{i}" for i in range(40, 50)]
            for key in later:
                await _publish_until_confirmed(stream, key, url)
            keys += later
            admin = redis.Redis(port=port)
            try:
                await wait_until(
                    lambda: len(ledger.counts()) == 50 and settled(admin, stream),
                    what="every message after the restart",
                )
                assert_settled(admin, stream)
            finally:
                admin.close()
            assert not task.done()  # the same consumer rode the restart out
        assert done_at_kill < 40  # the kill really was mid-run
        assert any("unavailable" in r.getMessage() for r in caplog.records)  # and was noticed
        assert ledger.counts() == dict.fromkeys(keys, 1)
        assert worker.counts["processed"] == 50
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.wait()


async def _publish_until_confirmed(stream: str, key: str, url: str) -> None:
    """A producer's retry loop: the same message id on every attempt (R2)."""
    for _ in range(100):
        try:
            await publish(stream, key, {"k": key}, url=url)
            return
        except oncely.BrokerUnavailable:
            await asyncio.sleep(0.05)
    raise AssertionError(f"could not publish {key}")
