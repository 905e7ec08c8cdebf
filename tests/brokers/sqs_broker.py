"""An SQS API for the tests: moto's server (``moto_server``, from the dev extras), started once
per test session on a free loopback port and stopped at exit. ``ONCELY_TEST_SQS_URL`` points
the tests at a running endpoint instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers.common import free_port
from tests.services import REQUIRED

_GIVEN = os.environ.get("ONCELY_TEST_SQS_URL")
_started: dict[str, str] = {}
_lock = threading.Lock()


def _refuse(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"ONCELY_REQUIRE_SERVICES=1 and {reason}")
    pytest.skip(reason)


def moto_server() -> Path | None:
    beside = Path(sys.executable).parent / "moto_server"
    if beside.exists():
        return beside
    found = shutil.which("moto_server")
    return Path(found) if found else None


def sqs_url() -> str:
    """The test endpoint's ``sqs://`` URL, starting moto's server on first use; skips (or, in
    CI, fails) when there is none."""
    if _GIVEN:
        return _GIVEN
    with _lock:
        if "url" not in _started:
            _started["url"] = _start_moto()[0]
        return _started["url"]


@contextlib.contextmanager
def private_sqs() -> Iterator[str]:
    """The ``sqs://`` URL of a moto server of the caller's own, stopped when the block ends
    (``ONCELY_TEST_SQS_URL``'s endpoint when given). The fleet tests run on one each: after a
    test's consumers were SIGKILLed on the shared server, its receives slowed about tenfold
    for the rest of the session (moto's, not the consumers': a fresh server answers the same
    fleet at full speed), and the next fleet could not finish in its time."""
    if _GIVEN:
        yield _GIVEN
        return
    url, process = _start_moto()
    try:
        yield url
    finally:
        _stop(process)


def _start_moto() -> tuple[str, subprocess.Popen[bytes]]:
    binary = moto_server()
    if binary is None:
        _refuse("no SQS API: install the dev extras (moto's server)")
    assert binary is not None
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moto-{port}.log"), "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    atexit.register(_stop, process)
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            _refuse(f"moto_server exited at start ({process.returncode}); see {log.name}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            break
        if time.monotonic() > deadline:
            _refuse(f"moto_server did not listen within 30 s; see {log.name}")
        time.sleep(0.05)
    return f"sqs://127.0.0.1:{port}", process


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    if process.poll() is None:
        process.kill()


def create_queue(name: str, url: str | None = None, **attributes: str) -> None:
    """Create ``name`` on the test endpoint, or ``url``'s (before any producer sends to it)."""
    import boto3

    client = boto3.client(
        "sqs",
        endpoint_url=(url or sqs_url()).replace("sqs://", "http://", 1),
        region_name="us-east-1",
        aws_access_key_id="oncely",
        aws_secret_access_key="oncely",
    )
    client.create_queue(QueueName=name, Attributes=attributes)


async def queue_depth(url: str, name: str) -> int:
    """Messages ``name`` holds, visible, in flight or delayed (0 for a queue that is gone)."""
    from oncely.brokers.sqs._endpoint import Endpoint

    endpoint, _ = Endpoint.from_url(url)
    async with endpoint.client() as client:
        try:
            queue = (await client.get_queue_url(QueueName=name))["QueueUrl"]
        except Exception:
            return 0
        found = await client.get_queue_attributes(
            QueueUrl=queue,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed",
            ],
        )
    return sum(int(v) for v in found["Attributes"].values())


async def delete_queues(url: str, *names: str) -> None:
    from oncely.brokers.sqs._endpoint import Endpoint

    endpoint, _ = Endpoint.from_url(url)
    async with endpoint.client() as client:
        for name in names:
            with contextlib.suppress(Exception):
                queue = (await client.get_queue_url(QueueName=name))["QueueUrl"]
                await client.delete_queue(QueueUrl=queue)
