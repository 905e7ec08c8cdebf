"""``oncely consume --broker kafka://...``: the command's own process reads a topic of the test
Kafka-protocol broker (Tansu), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.brokers.common import unique
from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url, produce_raw
from tests.cli.consume_broker import consume_orders_once

pytestmark = [pytest.mark.services, pytest.mark.slow]


TRANSACTIONAL = ("--mode", "transactional", "--handler", "tests.brokers.handlers:record_in")


@pytest.mark.parametrize(
    "options",
    [(), ("--batch", "1"), (*TRANSACTIONAL, "--store-offsets")],
    ids=["batches", "per-message", "stored-offsets"],
)
def test_consume_reads_a_kafka_topic_and_applies_each_message_once(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    url = kafka_url()
    topic = unique("cli_kafka")
    create_topic(topic, 2)
    try:
        consume_orders_once(f"{url}?session_timeout=6", url, topic, tmp_path, *options)
    finally:
        delete_topics(topic, f"{topic}.dead")
    if "--store-offsets" in options:  # each partition's next offset, kept in the inbox's file
        with sqlite3.connect(tmp_path / "inbox.db") as db:
            kept = db.execute(
                "SELECT stream, part, next_offset FROM oncely_inbox_offsets"
            ).fetchall()
        # kept under the topic's name and the id the cluster gave it (read before deletion)
        assert kept and {stream.split("@")[0] for stream, _, _ in kept} == {topic}
        assert all(len(stream) > len(topic) + 1 for stream, _, _ in kept)
        assert sum(next_offset for _, _, next_offset in kept) == 5  # 3 orders, 2 retries


def _dead_copies_and_commits(url: str, topic: str, group: str) -> tuple[list[Any], int]:
    """The records of ``topic``'s dead-letter topic, and the sum of ``group``'s committed
    offsets over ``topic``'s two partitions."""

    async def read() -> tuple[list[Any], int]:
        servers = url.removeprefix("kafka://")
        reader = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
        member = AIOKafkaConsumer(
            bootstrap_servers=servers, group_id=group, enable_auto_commit=False
        )
        await reader.start()
        await member.start()
        try:
            dead = TopicPartition(f"{topic}.dead", 0)
            reader.assign([dead])
            await reader.seek_to_beginning(dead)
            end = (await reader.end_offsets([dead]))[dead]
            copies: list[Any] = []
            for _ in range(50):
                if await reader.position(dead) >= end:
                    break
                for got in (await reader.getmany(timeout_ms=200)).values():
                    copies.extend(got)
            committed = [await member.committed(TopicPartition(topic, p)) for p in (0, 1)]
            return copies, sum(at or 0 for at in committed)
        finally:
            await reader.stop()
            await member.stop()

    return asyncio.run(read())


@pytest.mark.parametrize("tombstones", ["dead_letter", "handle"])
def test_consume_dead_letters_a_tombstone_without_record_key_or_message_id(
    tmp_path: Path, tombstones: str
) -> None:
    """A record with neither value nor record key, and no ``message-id`` header (a foreign
    producer's tombstone naming no key, R2), ahead of the orders in each partition: the
    command dead-letters each one on its own with the reason in its log (R16), copies it
    with its null value and null key, commits past it and goes on with the orders behind
    it; it exits cleanly on SIGTERM. With ``tombstones=handle`` the reason is the missing
    message id: a tombstone is never keyed on its (absent) record key."""
    url = kafka_url()
    topic = unique("cli_kafka_tomb")
    consumer = unique("cli")
    create_topic(topic, 2)
    try:
        for partition in (0, 1):
            produce_raw(url, topic, [(None, None, [])], partition)
        err = consume_orders_once(
            f"{url}?session_timeout=6&tombstones={tombstones}",
            url,
            topic,
            tmp_path,
            consumer=consumer,
        )
        copies, committed = _dead_copies_and_commits(url, topic, consumer)
    finally:
        delete_topics(topic, f"{topic}.dead")
    reason = (
        "no producer-assigned message id"
        if tombstones == "handle"
        else "the record has no value: a tombstone"
    )
    lines = [line for line in err.splitlines() if "action=dead_letter" in line]
    assert len(lines) == 2 and all("outcome=rejected" in line and reason in line for line in lines)
    for partition in (0, 1):  # each partition's own, at its first offset
        assert [line for line in lines if f"partition={partition} offset=0 " in line], err
    assert len(copies) == 2
    assert all(copy.value is None and copy.key is None for copy in copies)
    assert all(reason in dict(copy.headers)["x-oncely-reason"].decode() for copy in copies)
    assert committed == 7  # two tombstones and five orders
