"""``oncely consume --broker sqs://...``: the command's own process reads a queue of the test
SQS endpoint (moto's server), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import oncely
from tests.backends import dynamodb
from tests.brokers.common import unique
from tests.brokers.sqs_broker import create_queue, delete_queues, sqs_url
from tests.cli.consume_broker import ROOT, consume_orders_once, publish_orders

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_consume_reads_an_sqs_queue_and_applies_each_message_once(tmp_path: Path) -> None:
    url = sqs_url()
    queue = unique("cli_sqs")
    create_queue(queue)
    try:
        consume_orders_once(url, url, queue, tmp_path)
    finally:
        asyncio.run(delete_queues(url, queue, f"{queue}-dead"))


def test_consume_transactional_on_dynamodb_commits_each_order_with_its_marker(
    tmp_path: Path,
) -> None:
    """``--mode transactional`` with a DynamoDB store: the handler's ledger item and the
    inbox's marker go in one TransactWriteItems, so each order is booked once (the two
    producer retries answered as duplicates) and every booked order has its marker."""
    url = sqs_url()
    queue = unique("cli_sqs_dyn")
    create_queue(queue)
    inbox_table, ledger = f"oncely_cli_{queue}", f"oncely_ledger_{queue}"
    client = dynamodb.client()
    client.create_table(
        TableName=ledger,
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    consumer = unique("cli")
    command = [
        sys.executable, "-m", "oncely.cli", "consume",
        "--broker", url,
        "--source", queue,
        "--handler", "tests.brokers.handlers:book_in_dynamodb",
        "--store", f"dynamodb://{dynamodb.endpoint()}/{inbox_table}",
        "--mode", "transactional",
        "--consumer", consumer,
    ]  # fmt: skip
    env = {**os.environ, "ONCELY_TEST_LEDGER": ledger}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        asyncio.run(publish_orders(url, queue))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = client.scan(TableName=ledger, ConsistentRead=True)["Items"]
            if len(items) >= 3:
                break
            time.sleep(0.2)
        time.sleep(2)  # the duplicates settle too
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=60)
        items = client.scan(TableName=ledger, ConsistentRead=True)["Items"]
        booked = Counter(int(item["order"]["N"]) for item in items)
        store = oncely.open(f"dynamodb://{dynamodb.endpoint()}/{inbox_table}")
        try:
            markers = {n: store.get(consumer, f"order-{n}") for n in (1, 2, 3)}
        finally:
            store.close()
    finally:
        if process.poll() is None:
            process.kill()
        client.delete_table(TableName=ledger)
        dynamodb.drop_table(inbox_table)
        client.close()
        asyncio.run(delete_queues(url, queue, f"{queue}-dead"))
    assert process.returncode == 0, err
    assert booked == {1: 1, 2: 1, 3: 1}, (booked, err)
    assert err.count("outcome=duplicate") == 2, err
    assert all(m is not None and m.status is oncely.Status.COMPLETED for m in markers.values())
