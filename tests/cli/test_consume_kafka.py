"""``oncely consume --broker kafka://...``: the command's own process reads a topic of the test
Kafka-protocol broker (Tansu), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.brokers.common import unique
from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url
from tests.cli.consume_broker import consume_orders_once

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.mark.parametrize("options", [(), ("--batch", "1")], ids=["batches", "per-message"])
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
