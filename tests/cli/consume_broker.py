"""``oncely consume`` in a process of its own on a real broker, as the broker tests of the
command run it: five orders published (two of them producer retries), each applied once, the
process stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oncely.brokers import open_producer
from tests.brokers.common import unique

ROOT = Path(__file__).resolve().parents[2]


async def publish_orders(url: str, source: str) -> None:
    """Five orders to ``source``, two of them a producer's retries (the same message id)."""
    producer = open_producer(url, source)
    try:
        for order in (1, 2, 1, 3, 2):  # two producer retries
            body = json.dumps({"order": order}).encode()
            await producer.publish(body, message_id=f"order-{order}")
    finally:
        await producer.close()


def consume_orders_once(
    broker: str, url: str, source: str, tmp_path: Path, *options: str, consumer: str | None = None
) -> str:
    """Run ``oncely consume --broker url --source source`` while the orders are published,
    stop it with SIGTERM, and check it exited cleanly, applied orders 1, 2 and 3 once each,
    logged its redelivery horizon and answered the two retries as duplicates. Returns what
    the command wrote to stderr (its log)."""
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    command = [
        sys.executable, "-m", "oncely.cli", "consume",
        "--broker", broker,
        "--source", source,
        "--handler", "tests.brokers.handlers:record",
        "--store", f"sqlite:///{tmp_path / 'inbox.db'}",
        "--consumer", consumer or unique("cli"),
        *options,
    ]  # fmt: skip
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        asyncio.run(publish_orders(url, source))
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
    return err
