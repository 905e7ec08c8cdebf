"""``oncely consume --broker kafka://...``: the command's own process reads a topic of the test
Kafka-protocol broker (Tansu), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.brokers.common import unique
from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url
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
