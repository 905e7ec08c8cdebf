"""FastStream's NATS (JetStream) and Redis (streams) subscribers behind
``oncely.integrations.faststream.Idempotency``, end to end: the real ``faststream run``
worker on the machine's NATS server and Redis, effects counted in Redis. Duplicates, a
reused key, keyless messages, undecodable bodies, failures that recover and failures that do
not, a rejection, and a worker ``SIGKILL``ed mid-handler (R1, R2, R4, R10, R13, R16); then
FastStream's own ``TestNatsBroker`` and ``TestRedisBroker`` for users' unit tests, and the
subscribers the middleware refuses to run unprotected."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("faststream")
import nats
import nats.js.errors
import redis

import oncely
from tests.integrations.workers import WorkerRun, holding
from tests.services import NATS_URL, REDIS_URL, require

ORDERS = ("o1", "o2", "o3")
CUT = " ... [cut to fit the server's max_payload]"


class StreamRun(WorkerRun):
    """One scenario on one broker: its subject or stream, the worker processes, the effects;
    a producer that sends exactly what it is given, and the dead letters read back."""

    framework = "faststream"
    app_module = "tests.integrations.faststream_streams_app"
    broker: ClassVar[str]
    id_header: ClassVar[str]
    """The header a published result carries its message id in."""

    def __init__(self, store: str, lease: float = 30.0, takeover: float = 30.0) -> None:
        super().__init__(store, lease)
        self.env["ONCELY_TEST_FASTSTREAM_BROKER"] = self.broker
        self.env["ONCELY_TEST_FASTSTREAM_TAKEOVER"] = str(takeover)
        self.env["ONCELY_TEST_NATS_URL"] = NATS_URL

    def worker(self) -> subprocess.Popen[bytes]:
        return self.spawn("faststream", "run", f"{self.app_module}:app")

    def charge(self, key: str | None, order: str, amount: int = 10, **more: Any) -> None:
        body = json.dumps({"order": order, "amount": amount, **more}).encode()
        self.send([(body, key, "application/json", "")])

    def send(self, messages: list[tuple[bytes, str | None, str, str]]) -> None:
        """Publish ``(body, message id, content type, subject suffix)`` each."""
        raise NotImplementedError

    def _read(self, name: str) -> list[tuple[dict[str, str], bytes]]:
        """What the subject, stream or topic ``name`` holds: (headers, body) each."""
        raise NotImplementedError

    def dead(self) -> list[tuple[dict[str, str], bytes]]:
        """The dead letters: (headers, body) each, the oncely headers included."""
        return self._read(self.queue + ".dead")

    def receipts(self) -> list[tuple[str, str]]:
        """The results the handler published: (message id, order) each."""
        return [
            (headers.get(self.id_header, ""), json.loads(body)["order"])
            for headers, body in self._read(self.queue + ".receipts")
        ]

    def deliveries(self) -> int | None:
        """How many times the broker delivered messages of the source, where it says."""
        return None

    def cleanup(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for process in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        self.cleanup()
        for name in self.redis.scan_iter(match=f"{self.ns}:*"):
            self.redis.delete(name)
        self.redis.close()


class NatsRun(StreamRun):
    """JetStream: ids in ``message_id`` (FastStream's header, which the stream's duplicate
    window does not read, so the producer's retries reach the consumer) or in
    ``Oncely-Message-Id`` (oncely's producer), or none."""

    broker = "nats"
    id_header = "Nats-Msg-Id"

    def send(self, messages: list[tuple[bytes, str | None, str, str]]) -> None:
        from oncely.brokers.nats import stream_name_for

        async def go() -> None:
            client = await nats.connect(NATS_URL)
            try:
                js = client.jetstream()
                for suffix in ("", ".plain", ".receipts"):
                    subject = self.queue + suffix
                    with contextlib.suppress(nats.js.errors.BadRequestError):
                        await js.add_stream(name=stream_name_for(subject), subjects=[subject])
                for body, key, content_type, suffix in messages:
                    headers = {"content-type": content_type} if content_type else {}
                    if key is not None:
                        headers["Oncely-Message-Id" if key.startswith("o-") else "message_id"] = key
                    await js.publish(self.queue + suffix, body, headers=headers or None)
            finally:
                await client.close()

        asyncio.run(go())

    def _read(self, subject: str) -> list[tuple[dict[str, str], bytes]]:
        from oncely.brokers.nats import stream_name_for

        async def go() -> list[tuple[dict[str, str], bytes]]:
            client = await nats.connect(NATS_URL)
            found: list[tuple[dict[str, str], bytes]] = []
            try:
                js = client.jetstream()
                name = stream_name_for(subject)
                try:
                    info = await js.stream_info(name)
                except nats.js.errors.NotFoundError:
                    return found
                for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
                    with contextlib.suppress(nats.js.errors.NotFoundError):
                        msg = await js.get_msg(name, seq)
                        found.append((dict(msg.headers or {}), msg.data or b""))
            finally:
                await client.close()
            return found

        return asyncio.run(go())

    def deliveries(self) -> int | None:
        """How many deliveries the durable consumer made (redeliveries included)."""
        from oncely.brokers.nats import stream_name_for

        async def go() -> int:
            client = await nats.connect(NATS_URL)
            try:
                js = client.jetstream()
                info = await js.consumer_info(stream_name_for(self.queue), "billing")
                return int(info.delivered.consumer_seq or 0)
            finally:
                await client.close()

        return asyncio.run(go())

    def cleanup(self) -> None:
        from oncely.brokers.nats import stream_name_for

        async def go() -> None:
            client = await nats.connect(NATS_URL)
            try:
                js = client.jetstream()
                for suffix in ("", ".plain", ".receipts", ".dead"):
                    with contextlib.suppress(nats.js.errors.NotFoundError):
                        await js.delete_stream(stream_name_for(self.queue + suffix))
            finally:
                await client.close()

        asyncio.run(go())


class NatsPushRun(NatsRun):
    """JetStream through a push consumer that a queue group reads (``queue="billing"``: the
    durable consumer's name and its deliver group): the server hands each message to one
    member of the group, and a message a dead member held goes to another after the ack
    wait."""

    broker = "nats-push"


class RedisRun(StreamRun):
    """Redis streams: FastStream's own producer, the id in its ``message_id`` header, or none;
    the groups exist before the first entry (FastStream creates a missing one at the
    stream's end)."""

    broker = "redis"
    id_header = "message_id"

    def send(self, messages: list[tuple[bytes, str | None, str, str]]) -> None:
        from faststream.redis import RedisBroker

        client = redis.Redis.from_url(REDIS_URL)
        for suffix, group in (("", "billing"), (".plain", "plain")):
            with contextlib.suppress(redis.ResponseError):
                client.xgroup_create(self.queue + suffix, group, "0", mkstream=True)
        client.close()

        async def go() -> None:
            async with RedisBroker(REDIS_URL) as producer:
                for body, key, content_type, suffix in messages:
                    headers = {"content-type": content_type} if content_type else {}
                    if key is not None:
                        headers["message_id"] = key
                    await producer.publish(body, stream=self.queue + suffix, headers=headers)

        asyncio.run(go())

    def _read(self, stream: str) -> list[tuple[dict[str, str], bytes]]:
        from faststream.redis.parser.binary import BinaryMessageFormatV1

        found: list[tuple[dict[str, str], bytes]] = []
        for _id, fields in self.redis.xrange(stream):
            # What a FastStream subscriber of the stream reads: the headers of its format.
            body, headers = BinaryMessageFormatV1.parse(fields[b"__data__"])
            for name, value in fields.items():  # and oncely's fields beside it
                if name.startswith(b"x-oncely-"):
                    assert headers[name.decode()] == value.decode()
            found.append((headers, body))
        return found

    def cleanup(self) -> None:
        for suffix in ("", ".plain", ".receipts", ".dead"):
            self.redis.delete(self.queue + suffix)


class KafkaRun(StreamRun):
    """Kafka on Tansu: aiokafka as the producer, the id in the ``message-id`` header (or the
    CloudEvents pair ``ce_source``/``ce_id`` for ``o-`` keys), or none."""

    broker = "kafka"
    id_header = "message-id"
    suffixes = ("", ".plain", ".receipts")

    def __init__(self, store: str, lease: float = 30.0, takeover: float = 30.0) -> None:
        from tests.brokers.kafka_broker import create_topic, kafka_url

        super().__init__(store, lease, takeover)
        self.url = kafka_url()
        self.env["ONCELY_TEST_KAFKA_URL"] = self.url
        for suffix in self.suffixes:
            create_topic(self.queue + suffix, 1, self.url)

    def send(self, messages: list[tuple[bytes, str | None, str, str]]) -> None:
        from aiokafka import AIOKafkaProducer

        async def go() -> None:
            producer = AIOKafkaProducer(bootstrap_servers=self.url.removeprefix("kafka://"))
            await producer.start()
            try:
                for body, key, content_type, suffix in messages:
                    headers = [("content-type", content_type.encode())] if content_type else []
                    if key is not None and key.startswith("o-"):
                        headers += [
                            ("ce_specversion", b"1.0"),
                            ("ce_type", b"shop.order"),
                            ("ce_source", b"/shop"),
                            ("ce_id", key.encode()),
                        ]
                    elif key is not None:
                        headers.append(("message-id", key.encode()))
                    await producer.send_and_wait(self.queue + suffix, body, headers=headers)
            finally:
                await producer.stop()

        asyncio.run(go())

    def _read(self, topic: str) -> list[tuple[dict[str, str], bytes]]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async def go() -> list[tuple[dict[str, str], bytes]]:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.url.removeprefix("kafka://"))
            await consumer.start()
            found: list[tuple[dict[str, str], bytes]] = []
            try:
                partitions = consumer.partitions_for_topic(topic) or set()
                if not partitions:
                    await consumer._client.force_metadata_update()
                    partitions = consumer.partitions_for_topic(topic) or set()
                assigned = [TopicPartition(topic, p) for p in partitions]
                if not assigned:
                    return found
                consumer.assign(assigned)
                await consumer.seek_to_beginning(*assigned)
                ends = await consumer.end_offsets(assigned)
                for _ in range(100):
                    if all([await consumer.position(tp) >= ends[tp] for tp in assigned]):
                        break
                    batch = await consumer.getmany(timeout_ms=1000)
                    for records in batch.values():
                        for record in records:
                            headers = {k: (v or b"").decode() for k, v in record.headers}
                            found.append((headers, record.value or b""))
            finally:
                await consumer.stop()
            return found

        return asyncio.run(go())

    def cleanup(self) -> None:
        from tests.brokers.kafka_broker import delete_topics

        delete_topics(*(self.queue + suffix for suffix in (*self.suffixes, ".dead")))


RUNS: dict[str, type[StreamRun]] = {
    "nats": NatsRun,
    "nats-push": NatsPushRun,
    "redis": RedisRun,
    "kafka": KafkaRun,
}


@pytest.fixture(params=["nats", "nats-push", "redis", "kafka"])
def broker(request: pytest.FixtureRequest) -> str:
    require("Redis", REDIS_URL, 6379)
    if str(request.param).startswith("nats"):
        require("NATS", NATS_URL, 4222)
    return str(request.param)


@pytest.fixture
def store(broker: str, tmp_path: Path) -> Iterator[str]:
    """The inbox on SQLite for NATS and Kafka, on Redis for Redis streams (the store is not
    what these tests are about; both kinds are covered)."""
    if broker != "redis":
        yield f"sqlite:///{tmp_path / 'inbox.db'}"
        return
    unique = f"oncely_fss_{uuid.uuid4().hex[:8]}"
    yield f"{REDIS_URL}?prefix={unique}"
    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"{unique}*"):
        client.delete(name)
    client.close()


def _reason(headers: dict[str, str]) -> str:
    return headers.get("x-oncely-reason", "")


def _key(headers: dict[str, str]) -> str | None:
    return (
        headers.get("message_id")
        or headers.get("Oncely-Message-Id")
        or headers.get("message-id")
        or headers.get("ce_id")
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_r1_r2_r16_each_effect_once_and_every_refusal_dead_lettered_with_its_reason(
    broker: str, store: str
) -> None:
    run = RUNS[broker](store)
    try:
        charge = json.dumps
        run.send(
            [
                # A producer's retries: one logical message.
                *[(charge({"order": "o1", "amount": 10}).encode(), "m-o1", "application/json", "")]
                * 3,
                (charge({"order": "o2", "amount": 10}).encode(), "o-2", "application/json", ""),
                (  # fails twice, then succeeds
                    charge({"order": "o3", "amount": 10, "fail_times": 2}).encode(),
                    "m-o3",
                    "application/json",
                    "",
                ),
                (b'"p1"', None, "application/json", ".plain"),
            ]
        )
        run.worker()
        run.until(lambda: all(run.effects(order) == 1 for order in ORDERS))
        run.send(
            [
                # The key again, with another body.
                (charge({"order": "o2", "amount": 99}).encode(), "o-2", "application/json", ""),
                (charge({"order": "o6", "amount": 1}).encode(), None, "application/json", ""),
                (  # never succeeds
                    charge({"order": "o4", "amount": 1, "fail_times": 99}).encode(),
                    "m-o4",
                    "application/json",
                    "",
                ),
                (  # the handler refuses it
                    charge({"order": "o5", "amount": 1, "reject": True}).encode(),
                    "m-o5",
                    "application/json",
                    "",
                ),
                (b"\xff not json", "m-bad1", "application/json", ""),
                (b"\xff not a charge", "m-bad2", "", ""),  # no content type: bytes
                (b'"p2"', None, "application/json", ".plain"),  # the worker still works
            ]
        )
        run.until(lambda: len(run.dead()) >= 6 and run.effects("plain:p2") == 1)
        time.sleep(1.5)  # anything that would still arrive (a second dead letter of one)
        found = run.dead()
        for order in ORDERS:
            assert run.effects(order) == 1, order
        for order in ("o4", "o5", "o6"):
            assert run.effects(order) == 0, order
        assert run.effects("plain:p1") == 1
        assert run.started("o1") == 1  # the copies were not run
        assert run.started("o3") == 3  # two failures and the success, no more
        assert run.started("o4") == 3  # max_deliveries=3
        assert len(found) == 6, found
        by_key = {_key(headers): (headers, body) for headers, body in found}
        conflict, body = by_key["o-2"]
        assert conflict["x-oncely-outcome"] == "key_conflict"
        assert json.loads(body)["amount"] == 99  # the copy is the message, byte for byte
        failed = by_key["m-o4"][0]
        assert "failed on all 3 deliveries" in _reason(failed)
        assert "the ledger is down" in _reason(failed)
        assert failed["x-oncely-deliveries"] == "3"
        assert "not billable" in _reason(by_key["m-o5"][0])
        assert "undecodable body" in _reason(by_key["m-bad1"][0])
        assert by_key["m-bad1"][1] == b"\xff not json"
        assert "arguments" in _reason(by_key["m-bad2"][0])
        keyless, body = by_key[None]
        assert "no producer-assigned message id" in _reason(keyless)
        assert json.loads(body)["order"] == "o6"
        for headers, _ in found:
            assert headers["x-oncely-consumer"] == "billing"
        # Every result published from one key carries one id, derived from it: a replay of
        # o1's receipt (for a duplicate) is a copy that a downstream consumer drops. On
        # JetStream the receipts stream's duplicate window already drops it (R14).
        receipts = run.receipts()
        o1 = [message_id for message_id, order in receipts if order == "o1"]
        assert len(set(o1)) == 1 and o1[0], receipts
        assert len(o1) == (1 if broker.startswith("nats") else 3)  # Kafka: one id, no window
        assert {order for _, order in receipts} == set(ORDERS)
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r1_a_result_that_could_not_be_published_is_published_by_the_redelivery(
    tmp_path: Path,
) -> None:
    """The handler ran and its claim completed, then FastStream could not publish its result
    (the results' stream was gone): the error reached FastStream, whose default for a
    JetStream subscriber (``REJECT_ON_ERROR``) terminated the message, so the result was never
    published. The message is now given back, and once the stream is there again its
    redelivery, a duplicate, publishes the stored result: once, the handler not run again."""
    require("NATS", NATS_URL, 4222)
    run = NatsRun(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        from oncely.brokers.nats import stream_name_for

        receipts = run.queue + ".receipts"
        run.charge("m-r1", "r1")  # creates the streams
        run.worker()
        run.until(lambda: run.effects("r1") == 1)

        async def streams(change: str) -> None:
            client = await nats.connect(NATS_URL)
            try:
                js = client.jetstream()
                if change == "delete":  # then the next message (run.charge makes it again)
                    await js.delete_stream(stream_name_for(receipts))
                    body = json.dumps({"order": "r2", "amount": 10}).encode()
                    headers = {"content-type": "application/json", "message_id": "m-r2"}
                    await js.publish(run.queue, body, headers=headers)
                else:
                    await js.add_stream(name=stream_name_for(receipts), subjects=[receipts])
            finally:
                await client.close()

        asyncio.run(streams("delete"))
        run.until(lambda: run.effects("r2") == 1)
        time.sleep(1.0)  # its result's publish fails meanwhile
        asyncio.run(streams("add"))
        run.until(lambda: [order for _, order in run.receipts()] == ["r2"], seconds=30)
        time.sleep(1.0)
        assert [order for _, order in run.receipts()] == ["r2"]
        assert run.effects("r2") == 1 and run.started("r2") == 1 and run.dead() == []
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r16_a_dead_letter_near_nats_max_payload_is_written_with_its_reason_cut(
    tmp_path: Path,
) -> None:
    """A message the handler refuses whose body is close to the server's ``max_payload``
    (1 MiB by default): its dead-letter copy (the body, its headers and the ``x-oncely-*``
    ones) was larger than the server takes, so the server closed the connection at each
    try, the message was given back again and again, and the copy was never written. The
    reason is cut to fit, as the NATS transport of :mod:`oncely.brokers` does: the copy
    lands, its body whole (R16: a dead letter keeps every byte of the message)."""
    require("NATS", NATS_URL, 4222)

    async def server_max_payload() -> int:
        client = await nats.connect(NATS_URL)
        try:
            return int(client.max_payload)
        finally:
            await client.close()

    max_payload = asyncio.run(server_max_payload())
    run = NatsRun(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        order = "big-" + "b" * 600  # the reason names it: long enough to cut
        charge = {"order": order, "amount": 1, "reject": True, "pad": ""}
        room = max_payload - len(json.dumps(charge)) - 400  # the message's own headers fit
        big = json.dumps({**charge, "pad": "x" * room}).encode()
        run.send([(big, "m-big", "application/json", "")])
        run.worker()
        run.until(lambda: run.started(order) >= 1)
        run.until(lambda: len(run.dead()) >= 1, seconds=30)
        [(headers, body)] = run.dead()
        assert body == big  # every byte of the message
        assert headers["message_id"] == "m-big" and headers["x-oncely-outcome"] == "rejected"
        whole = f"handler rejected the message: order {order} is not billable"
        reason = _reason(headers)
        assert whole.startswith(reason.removesuffix(CUT)) and len(reason) < len(whole), reason
        assert run.started(order) == 1  # refused once, not given back to be run again
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_redis_copies_keep_the_fields_an_entry_repeats_in_order() -> None:
    """A stream entry may repeat a field name (``XADD s * a 1 a 2``). The copies oncely
    writes (a retry's at the stream's tail, a dead letter) were built from FastStream's
    reading of the entry, a dict, so they kept one of the repeated fields and lost the
    others. Here an entry FastStream's producer would write, with repeated fields of another
    producer's beside ``__data__``, fails on all three deliveries (two retry copies, then
    the dead letter), which holds every field of the entry, in order."""
    from faststream.redis.parser.binary import BinaryMessageFormatV1

    require("Redis", REDIS_URL, 6379)
    unique = f"oncely_fsr_{uuid.uuid4().hex[:8]}"
    run = RedisRun(f"{REDIS_URL}?prefix={unique}")
    try:
        run.send([])  # the groups
        body = json.dumps({"order": "o8", "amount": 1, "fail_times": 99}).encode()
        headers = {"content-type": "application/json", "message_id": "m-o8"}
        data = asyncio.run(
            BinaryMessageFormatV1.encode(
                message=body, reply_to=None, headers=headers, correlation_id="c-o8"
            )
        )
        extra = [b"tag", b"a", b"x", b"1", b"tag", b"b", b"tag", b"c"]
        run.redis.execute_command("XADD", run.queue, "*", b"__data__", data, *extra)
        run.worker()
        run.until(lambda: run.redis.xlen(run.queue + ".dead") == 1)
        ((_id, copy),) = run.redis.eval(
            "return redis.call('XRANGE', KEYS[1], '-', '+')", 1, run.queue + ".dead"
        )
        assert copy[0] == b"__data__"  # its headers gain the reasons, its body kept
        assert BinaryMessageFormatV1.parse(copy[1])[0] == body
        assert copy[2 : 2 + len(extra)] == extra, copy
        why = dict(zip(copy[2 + len(extra) :: 2], copy[3 + len(extra) :: 2], strict=True))
        assert why[b"x-oncely-outcome"] == b"rejected" and why[b"x-oncely-deliveries"] == b"3", why
        assert run.started("o8") == 3
    finally:
        run.close()
        client = redis.Redis.from_url(REDIS_URL)
        for name in client.scan_iter(match=f"{unique}*"):
            client.delete(name)
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_r10_a_worker_killed_mid_handler_is_redelivered_and_applied_once(
    broker: str, store: str
) -> None:
    """The worker is ``SIGKILL``ed while the handler sleeps before its effect. JetStream
    delivers the message again after the consumer's ack wait; on Redis the next worker's
    takeover subscriber claims the entry the dead worker left pending; on Kafka the dead
    member's partition goes to the next worker, from the last commit. The copy meets the dead
    worker's lease, takes the claim over once it lapsed, and runs: one effect."""
    run = RUNS[broker](store, lease=2.0, takeover=5.0)
    try:
        run.charge("m-k1", "k1", sleep=6.0)  # longer than the takeover: kept meanwhile
        first = run.worker()
        run.until(lambda: run.started("k1") == 1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker()
        run.until(lambda: run.effects("k1") == 1, seconds=90)
        time.sleep(2.0)
        assert run.effects("k1") == 1
        assert run.started("k1") == 2  # the killed run and the one that took over
        assert run.dead() == []
        # The handler that took over ran longer than the ack wait: the message was kept with
        # +WPI (every third of it) meanwhile, not delivered a third time.
        assert run.deliveries() in (None, 2)
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("broker", ["redis", "nats"], indirect=True)
def test_r10_r13_a_message_that_kills_its_worker_every_run_is_dead_lettered_after_3_runs(
    broker: str, store: str
) -> None:
    """The handler ends the whole worker process (``os._exit``, as the OOM killer would) on
    every run; a supervisor starts the worker again each time. The broker delivers the
    message again (Redis: the takeover subscriber's ``XAUTOCLAIM``; JetStream: after the ack
    wait) sooner than the dead run's inbox lease lapses, so it meets that live claim and is
    given back before a later delivery takes the claim over. No run ever settled, so nothing
    counted it: the message ran for ever (on Redis each give-back's copy also carried the
    count its entry was written with, losing the takeover Redis had counted). It runs
    ``max_deliveries`` (3) times, and is then dead-lettered, unrun, saying its earlier runs
    never finished."""
    run = RUNS[broker](store, lease=5.0, takeover=1.0)
    try:
        run.send([])
        run.charge("m-x1", "x1", exit_times=99)
        run.supervised(lambda: len(run.dead()) >= 1 or run.started("x1") > 4, seconds=150)
        calm = time.monotonic() + 3.0  # a further run or dead letter would show here
        run.supervised(lambda: time.monotonic() > calm)
        assert run.started("x1") == 3, run.dead()
        [(headers, _)] = run.dead()
        reason = _reason(headers)
        assert "not run again: its 3 earlier runs never finished" in reason, reason
        assert headers["x-oncely-outcome"] == "rejected"
        assert run.effects("x1") == 0
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_r10_r13_runs_that_never_finished_and_failures_count_together_on_redis(
    broker: str, store: str
) -> None:
    """The first run fails (its retry's copy carries the count), and every later run kills
    the worker. A give-back's copy carries the count Redis had for its delivery, takeovers
    included: the dead runs and the failure count together, three runs in all, not a fourth
    that the inbox's own count (of the dead runs in a row) would have allowed."""
    run = RUNS[broker](store, lease=5.0, takeover=1.0)
    try:
        run.send([])
        run.charge("m-x2", "x2", fail_times=1, exit_times=99)
        run.supervised(lambda: len(run.dead()) >= 1 or run.started("x2") > 4, seconds=150)
        calm = time.monotonic() + 3.0  # a further run or dead letter would show here
        run.supervised(lambda: time.monotonic() > calm)
        assert run.started("x2") == 3, run.dead()
        [(headers, _)] = run.dead()
        reason = _reason(headers)
        assert "its 3 earlier runs failed or never finished (the last 2" in reason, reason
        assert run.effects("x2") == 0
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("broker", ["redis", "nats"], indirect=True)
def test_r10_a_message_that_killed_its_worker_once_then_succeeds(broker: str, store: str) -> None:
    """A run that killed its worker once is no reason to give up: the next run, after the
    takeover, applies the message once, and nothing is dead-lettered."""
    run = RUNS[broker](store, lease=5.0, takeover=1.0)
    try:
        run.send([])
        run.charge("m-x3", "x3", exit_times=1)
        run.supervised(lambda: run.effects("x3") >= 1, seconds=120)
        calm = time.monotonic() + 3.0  # a further run or dead letter would show here
        run.supervised(lambda: time.monotonic() > calm)
        assert run.effects("x3") == 1
        assert run.started("x3") == 2
        assert run.dead() == []
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r8_r13_give_backs_are_not_failures_max_deliveries_counts_failed_runs(
    broker: str, store: str
) -> None:
    """Another worker holds the message's key (a live lease, renewed) and the copy is given
    back (``in_flight``) at least 4 times; then that worker fails and releases the key, and
    every run of the copy fails. ``max_deliveries`` (3) counts the failed runs, not the
    give-backs: JetStream's ``num_delivered`` counts both, so the copy was dead-lettered
    after a single failure, as "failed on all 5 deliveries". It now runs 3 times and its
    dead letter states the true number of failures. On Redis a give-back is a copy that
    keeps the count, and Kafka's a rewind that counts nothing: there every delivery the
    dead letter counts is a failed run."""
    run = RUNS[broker](store)
    body = json.dumps({"order": "g1", "amount": 1, "fail_times": 99}).encode()
    try:
        run.send([])  # the streams, topics or groups
        with holding(store, "m-g1", body) as fail:
            run.send([(body, "m-g1", "application/json", "")])
            run.worker()
            run.until(lambda: int(run.redis.get(f"{run.ns}:given_back:m-g1") or 0) >= 4)
            assert fail().outcome is oncely.Outcome.FAILED
        run.until(lambda: len(run.dead()) >= 1, seconds=60)
        time.sleep(1.0)  # a further run or dead letter would show here
        given_back = int(run.redis.get(f"{run.ns}:given_back:m-g1") or 0)
        [(headers, _)] = run.dead()
        assert run.started("g1") == 3, _reason(headers)
        assert "the ledger is down" in _reason(headers)
        if broker.startswith("nats"):  # JetStream counted every delivery; the copy says which
            deliveries = given_back + 3
            assert f"failed 3 times in {deliveries} deliveries ({given_back} given back unrun" in (
                _reason(headers)
            ), _reason(headers)
            assert headers["x-oncely-deliveries"] == str(deliveries)
            assert run.deliveries() == deliveries
        else:
            assert "failed on all 3 deliveries" in _reason(headers), _reason(headers)
            assert headers["x-oncely-deliveries"] == "3"
        assert run.effects("g1") == 0
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r13_give_backs_and_failures_together_stop_at_the_consumers_max_deliver(
    tmp_path: Path,
) -> None:
    """``max_deliveries`` (3) counts failures, not give-backs; the JetStream consumer's own
    ``max_deliver`` (6) still counts both, the safety net. A copy given back at least 4
    times while another worker holds its key, then failing each run, reaches
    ``max_deliver`` before its 3rd failure: what it is given on that last delivery
    dead-letters it with the broker limit's reason, never strands it unacknowledged."""
    require("NATS", NATS_URL, 4222)
    store = f"sqlite:///{tmp_path / 'inbox.db'}"
    run = NatsRun(store)
    run.env["ONCELY_TEST_FASTSTREAM_MAX_DELIVER"] = "6"
    body = json.dumps({"order": "g2", "amount": 1, "fail_times": 99}).encode()
    try:
        run.send([])
        with holding(store, "m-g2", body) as fail:
            run.send([(body, "m-g2", "application/json", "")])
            run.worker()
            run.until(lambda: int(run.redis.get(f"{run.ns}:given_back:m-g2") or 0) >= 4)
            fail()
        run.until(lambda: len(run.dead()) >= 1, seconds=60)
        time.sleep(1.0)
        given_back = int(run.redis.get(f"{run.ns}:given_back:m-g2") or 0)
        [(headers, _)] = run.dead()
        reason = _reason(headers)
        assert "delivered 6 times, the NATS subscriber's own delivery limit" in reason, reason
        assert headers["x-oncely-deliveries"] == "6"
        assert run.started("g2") == 6 - given_back < 3
        assert run.deliveries() == 6
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_r10_r13_a_queue_group_member_killed_mid_run_its_messages_go_to_the_other_once(
    tmp_path: Path,
) -> None:
    """Two workers read one JetStream push consumer as a queue group; one is ``SIGKILL``ed
    while its handler runs. What it held (the message in its handler and any pushed to it
    and not acknowledged) reaches the other member after the ack wait: every order's effect
    once, none lost, nothing dead-lettered."""
    require("Redis", REDIS_URL, 6379)
    require("NATS", NATS_URL, 4222)
    orders = [f"q{n}" for n in range(12)]
    run = NatsPushRun(f"sqlite:///{tmp_path / 'inbox.db'}", lease=2.0, takeover=5.0)
    try:
        for order in orders:
            run.charge(f"m-{order}", order, sleep=0.5)
        doomed = run.worker()
        run.worker()
        run.until(lambda: sum(run.started(order) for order in orders) >= 4)
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait(10)
        run.until(lambda: all(run.effects(order) == 1 for order in orders), seconds=90)
        time.sleep(2.0)  # a late copy would show here
        assert {order: run.effects(order) for order in orders} == dict.fromkeys(orders, 1)
        assert run.dead() == []
    finally:
        run.close()


async def test_r1_r2_with_faststreams_test_nats_broker_for_users_unit_tests() -> None:
    """The middleware under ``TestNatsBroker`` (no server): a duplicate runs once and
    replays the first result with an id derived from the key (``Nats-Msg-Id``), which the
    next subscriber behind the middleware drops; a failure is retried (published again, the
    test broker has nothing to give it back to) and dead-lettered after ``max_deliveries``;
    a keyless message and a reused key are dead-lettered to ``<subject>.dead`` with the
    reason."""
    from faststream.nats import JStream, NatsBroker, NatsMessage, PullSub, TestNatsBroker

    import oncely
    from oncely.brokers import Backoff
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    quick = Backoff(first=timedelta(milliseconds=10), most=timedelta(milliseconds=10))
    broker = NatsBroker(middlewares=[Idempotency(inbox, max_deliveries=2, backoff=quick)])
    effects: list[object] = []
    receipts: list[tuple[object, str | None]] = []
    dead: list[tuple[object, dict[str, Any]]] = []

    @broker.subscriber("orders", stream=JStream("orders"), durable="shop", pull_sub=PullSub())
    @broker.publisher("receipts")
    async def order(body: dict[str, int]) -> dict[str, int]:
        effects.append(body)
        if body["n"] == 4:
            raise RuntimeError("the ledger is down")
        return {"receipt": body["n"]}

    @broker.subscriber("receipts", stream=JStream("receipts"), durable="shop", pull_sub=PullSub())
    async def receipt(body: dict[str, int], message: NatsMessage) -> None:
        receipts.append((body, message.headers.get("Nats-Msg-Id")))

    @broker.subscriber("orders.dead")  # a dead-letter subject's subscriber is left alone
    async def dead_letter(message: NatsMessage) -> None:
        dead.append((message.body, dict(message.headers)))

    async with TestNatsBroker(broker) as test:
        for _ in range(2):
            await test.publish({"n": 1}, "orders", headers={"Nats-Msg-Id": "m-1"})
        await test.publish({"n": 2}, "orders")  # no id
        await test.publish({"n": 3}, "orders", headers={"Nats-Msg-Id": "m-1"})  # reused
        await test.publish({"n": 4}, "orders", headers={"Nats-Msg-Id": "m-4"})  # fails
    assert effects == [{"n": 1}, {"n": 4}, {"n": 4}]  # the failure retried once
    assert len(receipts) == 1 and receipts[0][0] == {"receipt": 1} and receipts[0][1]
    by_outcome = sorted((h["x-oncely-outcome"], h.get("Nats-Msg-Id", "")) for _, h in dead)
    assert by_outcome == [("key_conflict", "m-1"), ("rejected", ""), ("rejected", "m-4")]
    rejected = next(h for _, h in dead if "Nats-Msg-Id" not in h)
    assert "message id" in rejected["x-oncely-reason"]
    failed = next(h for _, h in dead if h.get("Nats-Msg-Id") == "m-4")
    assert "failed on all 2 deliveries" in failed["x-oncely-reason"]


async def test_r1_r2_with_faststreams_test_redis_broker_for_users_unit_tests() -> None:
    """The middleware under ``TestRedisBroker`` (no server): duplicates run once and replay
    the first result with one derived ``message_id`` (which the next subscriber drops), a
    failure is retried as a copy and dead-lettered after ``max_deliveries``, a keyless
    message and a reused key are dead-lettered to ``<stream>.dead`` with the reason."""
    from faststream.redis import RedisBroker, RedisMessage, StreamSub, TestRedisBroker

    import oncely
    from oncely.brokers import Backoff
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    quick = Backoff(first=timedelta(milliseconds=10), most=timedelta(milliseconds=10))
    broker = RedisBroker(middlewares=[Idempotency(inbox, max_deliveries=2, backoff=quick)])
    effects: list[object] = []
    receipts: list[tuple[object, str | None]] = []
    dead: list[tuple[object, dict[str, Any]]] = []

    @broker.subscriber(stream=StreamSub("orders", group="shop", consumer="c1"))
    @broker.publisher(stream="receipts")
    async def order(body: dict[str, int]) -> dict[str, int]:
        effects.append(body)
        if body["n"] == 4:
            raise RuntimeError("the ledger is down")
        return {"receipt": body["n"]}

    @broker.subscriber(stream=StreamSub("receipts", group="shop", consumer="c1"))
    async def receipt(body: dict[str, int], message: RedisMessage) -> None:
        receipts.append((body, message.headers.get("message_id")))

    @broker.subscriber(stream="orders.dead")  # a dead-letter stream's subscriber: left alone
    async def dead_letter(message: RedisMessage) -> None:
        dead.append((message.body, dict(message.headers)))

    async with TestRedisBroker(broker) as test:
        for _ in range(2):
            await test.publish({"n": 1}, stream="orders", headers={"message_id": "m-1"})
        await test.publish({"n": 2}, stream="orders")  # no id
        await test.publish({"n": 3}, stream="orders", headers={"message_id": "m-1"})  # reused
        await test.publish({"n": 4}, stream="orders", headers={"message_id": "m-4"})
        for _ in range(200):  # the retry's copy comes back after the backoff
            if len(dead) == 3:
                break
            await asyncio.sleep(0.05)
    assert effects == [{"n": 1}, {"n": 4}, {"n": 4}]
    assert len(receipts) == 1 and receipts[0][0] == {"receipt": 1} and receipts[0][1]
    by_outcome = sorted((h["x-oncely-outcome"], h.get("message_id", "")) for _, h in dead)
    assert by_outcome == [("key_conflict", "m-1"), ("rejected", ""), ("rejected", "m-4")]
    failed = next(h for _, h in dead if h.get("message_id") == "m-4")
    assert "failed on all 2 deliveries" in failed["x-oncely-reason"]
    assert failed["x-oncely-deliveries"] == "2"


async def test_r1_r3_with_faststreams_test_kafka_broker_for_users_unit_tests() -> None:
    """The middleware under ``TestKafkaBroker`` (no server): duplicates by ``message-id``
    and by the CloudEvents pair run once and replay the first result with one derived
    ``message-id``, a failure is retried as a copy and dead-lettered after
    ``max_deliveries``, a keyless record and a reused key go to ``<topic>.dead`` with the
    reason and where the record was."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, KafkaMessage, TestKafkaBroker

    import oncely
    from oncely.brokers import Backoff
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    quick = Backoff(first=timedelta(milliseconds=10), most=timedelta(milliseconds=10))
    broker = KafkaBroker(middlewares=[Idempotency(inbox, max_deliveries=2, backoff=quick)])
    effects: list[object] = []
    receipts: list[tuple[dict[str, int], str | None]] = []
    dead: list[dict[str, Any]] = []
    event = {"ce_specversion": "1.0", "ce_type": "shop.order", "ce_source": "/shop", "ce_id": "e5"}

    @broker.subscriber("orders", group_id="shop", ack_policy=AckPolicy.ACK)
    @broker.publisher("receipts")
    async def order(body: dict[str, int]) -> dict[str, int]:
        effects.append(body)
        if body["n"] == 4:
            raise RuntimeError("the ledger is down")
        return {"receipt": body["n"]}

    @broker.subscriber("receipts", group_id="shop", ack_policy=AckPolicy.ACK)
    async def receipt(body: dict[str, int], message: KafkaMessage) -> None:
        receipts.append((body, message.headers.get("message-id")))

    @broker.subscriber("orders.dead")  # a dead-letter topic's subscriber is left alone
    async def dead_letter(message: KafkaMessage) -> None:
        dead.append(dict(message.headers))

    async with TestKafkaBroker(broker) as test:
        for _ in range(2):
            await test.publish({"n": 1}, "orders", headers={"message-id": "m-1"})
            await test.publish({"n": 5}, "orders", headers=event)
        await test.publish({"n": 2}, "orders")  # no id
        await test.publish({"n": 3}, "orders", headers={"message-id": "m-1"})  # reused
        await test.publish({"n": 4}, "orders", headers={"message-id": "m-4"})
    assert effects == [{"n": 1}, {"n": 5}, {"n": 4}, {"n": 4}]
    assert sorted(body["receipt"] for body, _ in receipts) == [1, 5]
    assert all(message_id for _, message_id in receipts)
    by_outcome = sorted((h["x-oncely-outcome"], h.get("message-id", "")) for h in dead)
    assert by_outcome == [("key_conflict", "m-1"), ("rejected", ""), ("rejected", "m-4")]
    failed = next(h for h in dead if h.get("message-id") == "m-4")
    assert "failed on all 2 deliveries" in failed["x-oncely-reason"]
    assert failed["x-oncely-topic"] == "orders" and "x-oncely-offset" in failed


async def test_r2_r3_an_event_and_a_message_id_it_spells_never_share_a_key() -> None:
    """A Kafka record without a message id is keyed by its CloudEvents pair, as
    ``"<source> <id>"``; a record whose producer's id is that same text (it has a space) is
    another message. Before, both were keyed ``"/shop e1"`` and the second was skipped as a
    duplicate; now the spaced id is refused (dead-lettered with the reason), and the event
    runs."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, KafkaMessage, TestKafkaBroker

    import oncely
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    broker = KafkaBroker(middlewares=[Idempotency(inbox)])
    effects: list[object] = []
    dead: list[dict[str, Any]] = []
    event = {"ce_specversion": "1.0", "ce_type": "shop.order", "ce_source": "/shop", "ce_id": "e1"}

    @broker.subscriber("orders", group_id="shop", ack_policy=AckPolicy.ACK)
    async def order(body: dict[str, int]) -> None:
        effects.append(body)

    @broker.subscriber("orders.dead")
    async def dead_letter(message: KafkaMessage) -> None:
        dead.append(dict(message.headers))

    async with TestKafkaBroker(broker) as test:
        await test.publish({"n": 1}, "orders", headers=event)
        # The same body: before, a silent duplicate, not even a key_conflict.
        await test.publish({"n": 1}, "orders", headers={"message-id": "/shop e1"})
        await test.publish({"n": 1}, "orders", headers={"message_id": "/shop e1"})
    assert effects == [{"n": 1}]
    assert len(dead) == 2
    assert all(h["x-oncely-outcome"] == "rejected" for h in dead)
    assert all("has a space" in h["x-oncely-reason"] for h in dead)


async def test_r18_subscribers_that_cannot_redeliver_are_refused_never_run_unprotected() -> None:
    """Core NATS, a JetStream consumer that is not durable, Redis pub/sub, lists, a stream
    read without a consumer group, a Kafka subscriber without a group or with automatic
    commits, and an ack policy that acknowledges whatever happens: the message is refused
    with a ConfigurationError that says why, and the handler never runs."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, TestKafkaBroker
    from faststream.nats import JStream, NatsBroker, TestNatsBroker
    from faststream.redis import RedisBroker, TestRedisBroker

    import oncely
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    ran: list[object] = []

    async def handler(body: dict[str, int]) -> None:
        ran.append(body)

    nats_broker = NatsBroker(middlewares=[Idempotency(inbox)])
    nats_broker.subscriber("core")(handler)
    nats_broker.subscriber("ephemeral", stream=JStream("ephemeral"))(handler)
    nats_broker.subscriber(
        "first", stream=JStream("first"), queue="q", ack_policy=AckPolicy.ACK_FIRST
    )(handler)
    async with TestNatsBroker(nats_broker) as test:
        for subject, why in (
            ("core", "core NATS"),
            ("ephemeral", "not durable"),
            ("first", "ack_policy"),
        ):
            with pytest.raises(oncely.ConfigurationError, match=why):
                await test.publish({"n": 1}, subject, headers={"Nats-Msg-Id": "m-1"})

    redis_broker = RedisBroker(middlewares=[Idempotency(inbox)])
    redis_broker.subscriber("channel")(handler)
    redis_broker.subscriber(list="list")(handler)
    redis_broker.subscriber(stream="nogroup")(handler)
    async with TestRedisBroker(redis_broker) as test:
        for where, why in (
            ({"channel": "channel"}, "pub/sub"),
            ({"list": "list"}, "list"),
            ({"stream": "nogroup"}, "consumer group"),
        ):
            with pytest.raises(oncely.ConfigurationError, match=why):
                await test.publish({"n": 1}, headers={"message_id": "m-1"}, **where)
    kafka_broker = KafkaBroker(middlewares=[Idempotency(inbox)])
    kafka_broker.subscriber("auto", group_id="g")(handler)  # FastStream's default: ACK_FIRST
    kafka_broker.subscriber("nogroup", ack_policy=AckPolicy.ACK)(handler)
    async with TestKafkaBroker(kafka_broker) as test:
        for topic, why in (("auto", "commits automatically"), ("nogroup", "consumer group")):
            with pytest.raises(oncely.ConfigurationError, match=why):
                await test.publish({"n": 1}, topic, headers={"message-id": "m-1"})
    assert ran == []


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_r10_kafka_a_copy_meeting_a_running_claim_is_read_again_in_place() -> None:
    """On Kafka a message given back (here: another worker holds its key) is not copied:
    the partition waits out ``requeue_delay`` and the consumer is rewound to the record,
    nothing committed past it. Once the other worker lets go, the record runs, once, and is
    committed; the topic still holds that one record."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    import oncely
    from oncely.integrations.faststream import Idempotency
    from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url

    url = kafka_url()
    servers = url.removeprefix("kafka://")
    topic = f"oncely_fk_{uuid.uuid4().hex[:8]}"
    create_topic(topic, 1, url)
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="billing")
    middleware = Idempotency(inbox, requeue_delay=timedelta(milliseconds=200))
    broker = KafkaBroker(servers, middlewares=[middleware])
    ran: list[object] = []

    @broker.subscriber(
        topic, group_id="billing", auto_offset_reset="earliest", ack_policy=AckPolicy.ACK
    )
    async def handle(body: dict[str, int]) -> None:
        ran.append(body)

    body = b'{"n": 1}'
    elsewhere = await inbox.claim("m-r1", body)  # another worker is running this message
    assert elsewhere.won
    try:
        async with broker:
            await broker.start()
            headers = {"message-id": "m-r1", "content-type": "application/json"}
            await broker.publish(body, topic, headers=headers)
            await asyncio.sleep(3)  # read, given back, read again, ... never run
            assert ran == []
            await elsewhere.release()
            for _ in range(300):
                if ran:
                    break
                await asyncio.sleep(0.1)
            assert ran == [{"n": 1}]
            await asyncio.sleep(1)
        assert ran == [{"n": 1}]
        consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id="billing")
        await consumer.start()
        try:
            partition = TopicPartition(topic, 0)
            assert (await consumer.end_offsets([partition]))[partition] == 1  # no copy
            assert await consumer.committed(partition) == 1  # and done
        finally:
            await consumer.stop()
    finally:
        delete_topics(topic, topic + ".dead")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_r2_kafka_a_record_faststream_cannot_read_is_dead_lettered_not_passed_over() -> None:
    """FastStream's Kafka parser decodes every header as UTF-8: a record with one that is not
    never reaches the middleware's claim, and the next commit would pass over it. It is
    dead-lettered with the error and its headers byte for byte; the next record runs."""
    import base64

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    import oncely
    from oncely.integrations.faststream import Idempotency
    from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url

    url = kafka_url()
    servers = url.removeprefix("kafka://")
    topic = f"oncely_fk_{uuid.uuid4().hex[:8]}"
    create_topic(topic, 1, url)
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="billing")
    broker = KafkaBroker(servers, middlewares=[Idempotency(inbox)])
    ran: list[object] = []

    @broker.subscriber(
        topic, group_id="billing", auto_offset_reset="earliest", ack_policy=AckPolicy.ACK
    )
    async def handle(body: dict[str, int]) -> None:
        ran.append(body)

    try:
        producer = AIOKafkaProducer(bootstrap_servers=servers)
        await producer.start()
        try:
            bad = [("message-id", b"m-bad"), ("trace", b"\xff\xfe")]
            await producer.send_and_wait(topic, b'{"n": 1}', headers=bad)
            good = [("message-id", b"m-good"), ("content-type", b"application/json")]
            await producer.send_and_wait(topic, b'{"n": 2}', headers=good)
        finally:
            await producer.stop()
        async with broker:
            await broker.start()
            for _ in range(300):
                if ran:
                    break
                await asyncio.sleep(0.1)
        assert ran == [{"n": 2}]
        reader = AIOKafkaConsumer(bootstrap_servers=servers, auto_offset_reset="earliest")
        await reader.start()
        try:
            partition = TopicPartition(topic + ".dead", 0)
            reader.assign([partition])
            records = (await reader.getmany(partition, timeout_ms=10_000)).get(partition, [])
        finally:
            await reader.stop()
        assert len(records) == 1
        headers = {name: (value or b"").decode() for name, value in records[0].headers}
        assert records[0].value == b'{"n": 1}'
        assert headers["message-id"] == "m-bad"
        assert headers["x-oncely-outcome"] == "rejected"
        assert "could not read" in headers["x-oncely-reason"]
        raw = base64.b64decode(headers["x-oncely-raw-headers"])
        assert raw == b"trace: \xff\xfe\r\n"
    finally:
        delete_topics(topic, topic + ".dead")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_r2_r16_kafka_a_tombstone_is_dead_lettered_as_one_never_run_nor_acked() -> None:
    """A tombstone (a record whose value is null: on a compacted topic, the deletion of its
    record key) reaching a FastStream Kafka subscriber under oncely: the handler never runs
    with an empty body, and the record is not committed past silently either. It is
    dead-lettered (``rejected``) with a reason saying it is a tombstone, keyed or not (most
    foreign producers write tombstones without headers), or one FastStream could not read (a
    null header), and its copy is a tombstone still: a null value, its record key and
    headers kept, so nothing is lost (R2, R16). The record after them runs; everything is
    committed."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    import oncely
    from oncely.integrations.faststream import Idempotency
    from tests.brokers.kafka_broker import create_topic, delete_topics, kafka_url

    url = kafka_url()
    servers = url.removeprefix("kafka://")
    topic = f"oncely_fkt_{uuid.uuid4().hex[:8]}"
    create_topic(topic, 1, url)
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="billing")
    broker = KafkaBroker(servers, middlewares=[Idempotency(inbox)])
    ran: list[object] = []

    @broker.subscriber(
        topic, group_id="billing", auto_offset_reset="earliest", ack_policy=AckPolicy.ACK
    )
    async def handle(body: object) -> None:
        ran.append(body)

    try:
        producer = AIOKafkaProducer(bootstrap_servers=servers)
        await producer.start()
        try:
            keyed = [("message-id", b"m-t1"), ("trace", b"t-1")]
            await producer.send_and_wait(topic, None, key=b"customer-7", headers=keyed)
            await producer.send_and_wait(topic, None, key=b"customer-8")  # a foreign one
            # A null header, which FastStream's parser cannot read: no handler sees it.
            nulled = [("message-id", b"m-t3"), ("trace", None)]
            await producer.send_and_wait(topic, None, key=b"customer-6", headers=nulled)
            good = [("message-id", b"m-good"), ("content-type", b"application/json")]
            await producer.send_and_wait(topic, b'{"n": 2}', key=b"customer-9", headers=good)
        finally:
            await producer.stop()
        async with broker:
            await broker.start()
            for _ in range(300):
                if ran:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1)  # anything that would still run (a tombstone after all)
        assert ran == [{"n": 2}]
        reader = AIOKafkaConsumer(bootstrap_servers=servers, group_id="billing")
        await reader.start()
        try:
            partition = TopicPartition(topic, 0)
            assert (await reader.end_offsets([partition]))[partition] == 4  # no copy
            assert await reader.committed(partition) == 4  # every record done
        finally:
            await reader.stop()
        reader = AIOKafkaConsumer(bootstrap_servers=servers, auto_offset_reset="earliest")
        await reader.start()
        try:
            dead = TopicPartition(topic + ".dead", 0)
            reader.assign([dead])
            records: list[Any] = []
            for _ in range(20):
                got = await reader.getmany(dead, timeout_ms=1000)
                records += got.get(dead, [])
                if len(records) >= 3:
                    break
            await asyncio.sleep(1)  # a fourth would be a tombstone dead-lettered twice
            records += (await reader.getmany(dead, timeout_ms=500)).get(dead, [])
        finally:
            await reader.stop()
        assert [r.key for r in records] == [b"customer-7", b"customer-8", b"customer-6"]
        for record in records:
            assert record.value is None  # a tombstone still, not an empty value
            headers = dict(record.headers)
            assert headers["x-oncely-outcome"] == b"rejected"
            assert headers["x-oncely-consumer"] == b"billing"
            reason = headers["x-oncely-reason"].decode()
            assert "tombstone" in reason and "FastStream subscriber" in reason, reason
            assert headers["x-oncely-topic"] == topic.encode()
        first = dict(records[0].headers)
        assert first["message-id"] == b"m-t1"
        assert first["trace"] == b"t-1" and first["x-oncely-offset"] == b"0"
        assert dict(records[1].headers)["x-oncely-offset"] == b"1"
        unread = dict(records[2].headers)
        assert unread["message-id"] == b"m-t3" and unread["x-oncely-offset"] == b"2"
        reason = unread["x-oncely-reason"].decode()
        assert "could not read" in reason and "'trace' is null" in reason, reason
    finally:
        delete_topics(topic, topic + ".dead")
