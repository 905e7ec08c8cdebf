"""``oncely consume --broker sqs://...``: the command's own process reads a queue of the test
SQS endpoint (moto's server), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.brokers.common import unique
from tests.brokers.sqs_broker import create_queue, delete_queues, sqs_url
from tests.cli.consume_broker import consume_orders_once

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_consume_reads_an_sqs_queue_and_applies_each_message_once(tmp_path: Path) -> None:
    url = sqs_url()
    queue = unique("cli_sqs")
    create_queue(queue)
    try:
        consume_orders_once(url, url, queue, tmp_path)
    finally:
        asyncio.run(delete_queues(url, queue, f"{queue}-dead"))
