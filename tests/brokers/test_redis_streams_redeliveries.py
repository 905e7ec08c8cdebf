"""Redis Streams end to end, against a real Redis: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and nothing pending in the consumer group (XPENDING 0, lag 0).

Transactional mode runs on PostgreSQL (the effect and the marker in one transaction, R7);
two-phase mode on Redis (a claim, the handler, a completion, R10).

Here the redeliveries: an entry taken over by XAUTOCLAIM, a handler slower than ack_wait,
two consumers with copies at once, failures retried then dead-lettered, ``in_flight`` given
back and never acked.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import redis

import oncely
from oncely.brokers import DeadLetter
from tests.brokers.common import Ledger, running, wait_until
from tests.brokers.redis_streams_helpers import (
    GROUP,
    MS,
    _fetch_into,
    assert_settled,
    consumer,
    consumers_in_group,
    dead_letters,
    publish,
    settings,
    settled,
    total,
    transport,
)

# ---------------------------------------------------------------------- the transport itself


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


# ---------------------------------------------------------------------- required scenarios


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
