"""``oncely consume --broker sqs://...``: the command's own process reads a queue of the test
SQS endpoint (moto's server), applies each message once and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oncely.brokers import open_producer
from tests.brokers.common import unique
from tests.brokers.sqs_broker import create_queue, sqs_url

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


async def _publish(url: str, queue: str) -> None:
    producer = open_producer(url, queue)
    try:
        for order in (1, 2, 1, 3, 2):  # two producer retries
            body = json.dumps({"order": order}).encode()
            await producer.publish(body, message_id=f"order-{order}")
    finally:
        await producer.close()


def test_consume_reads_an_sqs_queue_and_applies_each_message_once(tmp_path: Path) -> None:
    url = sqs_url()
    queue = unique("cli_sqs")
    create_queue(queue)
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    command = [
        sys.executable, "-m", "oncely.cli", "consume",
        "--broker", url,
        "--source", queue,
        "--handler", "tests.brokers.handlers:record",
        "--store", f"sqlite:///{tmp_path / 'inbox.db'}",
        "--consumer", unique("cli-sqs"),
    ]  # fmt: skip
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        asyncio.run(_publish(url, queue))
        deadline = time.monotonic() + 60
        while len(effects.read_text().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # the duplicates settle too
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    done = sorted(json.loads(line)["order"] for line in effects.read_text().splitlines())
    assert done == [1, 2, 3]
    assert "redelivery horizon" in err
    assert err.count("outcome=duplicate") == 2, err
