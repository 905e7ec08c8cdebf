"""FastStream subscribers behind ``oncely.integrations.faststream.Idempotency``, end to end:
the real ``faststream run`` worker on the machine's RabbitMQ, the inbox on SQLite and Redis,
effects counted in Redis. Duplicates, a reused key, keyless messages and ids the client made
up, undecodable bodies, failures that recover and failures that do not, a rejection, and a
worker ``SIGKILL``ed mid-handler (R1, R2, R4, R10, R13, R16); then FastStream's own
``TestRabbitBroker`` for users' unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("faststream")
import aio_pika
import pika

import oncely
from oncely.brokers.rabbitmq._delivery import MADE_UP_NOTE, NO_MESSAGE_ID_HEADER, made_up_reason
from tests.integrations.workers import WorkerRun, holding, stopped_at_start, store_url, until
from tests.services import RABBITMQ_URL


class Run(WorkerRun):
    """One scenario's queues, inbox and effects, and the app module configured for them."""

    framework = "faststream"
    app_module = "tests.integrations.faststream_app"
    queue_suffixes = (
        "", ".plain", ".receipts", ".files", ".copies", ".first", ".quorum", ".quorum.dead",
        ".dead",
    )  # fmt: skip

    def __init__(self, store: str, lease: float = 30.0) -> None:
        super().__init__(store, lease)
        with self.channel() as channel:  # the queues exist before the first publish
            for suffix in self.queue_suffixes[:-3]:  # the app declares its quorum queue
                name = self.queue + suffix
                channel.queue_declare(name, durable=True)

    def app(self) -> ModuleType:
        return self.load_app()

    def worker(self, log: Path | None = None) -> subprocess.Popen[bytes]:
        return self.spawn("faststream", "run", f"{self.app_module}:app", log=log)

    def charge(
        self,
        message_id: str | None,
        order: str,
        amount: int = 10,
        headers: dict[str, Any] | None = None,
        **more: Any,
    ) -> None:
        body = json.dumps({"order": order, "amount": amount, **more}).encode()
        self.publish(body, message_id, content_type="application/json", headers=headers)

    def publish(
        self,
        body: bytes,
        message_id: str | None,
        *,
        queue: str = "",
        content_type: str = "",
        headers: dict[str, Any] | None = None,
    ) -> None:
        """A producer on another client (pika), which sends what it is given: no id is made
        up for a message without one, a header name is sent whole (up to 255 bytes)."""
        properties = pika.BasicProperties(
            message_id=message_id,
            content_type=content_type or None,
            delivery_mode=2,
            headers=headers,
        )
        with self.channel() as channel:
            channel.basic_publish("", queue or self.queue, body, properties)

    def publish_with_aio_pika(self, body: bytes) -> None:
        """aio-pika, as FastStream publishes: its client gives the message a random id."""

        async def send() -> None:
            connection = await aio_pika.connect(RABBITMQ_URL)
            async with connection:
                channel = await connection.channel()
                message = aio_pika.Message(body, content_type="application/json")
                await channel.default_exchange.publish(message, routing_key=self.queue)

        asyncio.run(send())


def _until(check: Callable[[], bool], seconds: float = 60, run: Run | None = None) -> None:
    until(check, seconds, None if run is None else run.redis, "" if run is None else run.ns)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url(request, tmp_path, "oncely_fsi")


def _reason(properties: Any) -> str:
    return str((properties.headers or {}).get("x-oncely-reason", ""))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_app_whose_store_is_down_does_not_start(tmp_path: Path) -> None:
    """``faststream run`` with ``on_startup=[idempotency.prepare]`` and a store where nothing
    answers: one line naming the store (its password hidden) and exit status 3, as ``oncely
    consume``; the message waits, never run. Before, FastStream printed the error's
    traceback and exited with 1 (before the hook, the app started and gave every message
    back to RabbitMQ until the store answered)."""
    said = stopped_at_start(
        Run,
        lambda run: run.charge("m-u1", "u1"),
        lambda run, log: run.worker(log=log),
        tmp_path / "worker.log",
    )
    assert "started successfully" not in said, said


@pytest.mark.timeout(120)
def test_several_workers_whose_store_is_down_stop_instead_of_restarting_forever(
    tmp_path: Path,
) -> None:
    """``faststream run --workers 2`` on a store where nothing answers. FastStream's
    supervisor starts a worker again whatever its exit status, so each worker stopped at
    start, was started again and stopped again, without end. Now the first worker to stop
    asks the supervisor to stop: it stops its workers and ends, the message untouched."""
    said = stopped_at_start(
        Run,
        lambda run: run.charge("m-u1", "u1"),
        lambda run, log: run.spawn(
            "faststream", "run", f"{run.app_module}:app", "--workers", "2", log=log
        ),
        tmp_path / "workers.log",
        code=0,  # the supervisor's own status: FastStream's, whatever its workers'
    )
    assert "stops, and with it FastStream's supervisor" in said, said
    assert "Stopping parent process" in said and "started successfully" not in said, said
    assert said.count("Started child process") <= 3, said  # 2, and one it had restarted


@pytest.mark.timeout(120)
def test_an_app_with_a_subscriber_oncely_cannot_protect_does_not_start(tmp_path: Path) -> None:
    """An ``AckPolicy.ACK_FIRST`` subscriber behind the middleware: the app started, and each
    message was acknowledged by FastStream, refused by oncely and so dropped, never run."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    run.env["ONCELY_TEST_FASTSTREAM_ACK_FIRST"] = "1"
    try:
        run.publish(b'"a1"', "m-a1", queue=f"{run.queue}.first", content_type="application/json")
        log = tmp_path / "worker.log"
        assert run.worker(log=log).wait(60) == 2  # a usage error, as the oncely command's
        said = log.read_text(errors="replace")
        assert "the worker stops before taking a message" in said and "ACK_FIRST" in said, said
        assert "Traceback" not in said and "[exit 2]" in said, said
        assert "started successfully" not in said, said
        assert run.effects("first:a1") == 0
        assert len(run.taken(".first")) == 1  # still there, for the app once it is fixed
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r1_r2_r16_each_effect_once_and_every_refusal_dead_lettered_with_its_reason(
    store: str,
) -> None:
    run = Run(store)
    try:
        for _ in range(3):
            run.charge("m-o1", "o1")  # a producer's retries: one logical message
        run.charge("m-o2", "o2")
        run.charge("m-o3", "o3", fail_times=2)  # fails twice, then succeeds
        run.publish(b'"p1"', None, queue=f"{run.queue}.plain")
        run.worker()
        _until(
            lambda: run.effects("o1") == 1 and run.effects("o2") == 1 and run.effects("o3") == 1,
            run=run,
        )
        run.charge("m-o2", "o2", amount=99)  # the key again, with another body
        run.charge(None, "o6")  # no id: the producer gave none
        run.publish_with_aio_pika(b'{"order": "o7", "amount": 1}')  # the client's made-up id
        # Never succeeds; two header names AMQP carries whole (up to 255 bytes) that share
        # their first 128 bytes, where the client library cut them: one was lost from each
        # copy sent again and from the dead letter.
        long = {"x-" + "p" * 126 + "-first": "1", "x-" + "p" * 126 + "-second": "2"}
        run.charge("m-o4", "o4", headers=long, fail_times=99)
        run.charge("m-o5", "o5", reject=True)  # the handler refuses it
        run.publish(b"\xff not json", "m-bad1", content_type="application/json")
        run.publish(b"\xff not a charge", "m-bad2")  # no content type: bytes, not a Charge
        run.publish(b'"p2"', None, queue=f"{run.queue}.plain")  # the worker still works
        found: list[tuple[Any, bytes]] = []

        def drained() -> bool:
            found.extend(run.taken(".dead"))
            return len(found) >= 7 and run.effects("plain:p2") == 1

        _until(drained, run=run)
        time.sleep(1.5)  # anything that would still arrive (a second dead letter of one)
        found.extend(run.taken(".dead"))
        assert run.effects("o1") == 1 and run.effects("o2") == 1 and run.effects("o3") == 1
        for order in ("o4", "o5", "o6", "o7"):
            assert run.effects(order) == 0, order
        assert run.effects("plain:p1") == 1
        assert run.started("o3") == 3  # two failures and the success, no more
        assert run.started("o4") == 3  # max_deliveries=3
        by_id = {p.message_id: (p, body) for p, body in found}
        assert len(found) == 7, [(p.message_id, p.headers) for p, _ in found]
        conflict, body = by_id["m-o2"]
        assert conflict.headers["x-oncely-outcome"] == "key_conflict"
        assert json.loads(body)["amount"] == 99  # the copy is the message, byte for byte
        assert "failed on all 3 deliveries" in _reason(by_id["m-o4"][0])
        assert "the ledger is down" in _reason(by_id["m-o4"][0])
        assert long.items() <= by_id["m-o4"][0].headers.items()  # after two copies sent again
        assert "not billable" in _reason(by_id["m-o5"][0])
        assert "undecodable body" in _reason(by_id["m-bad1"][0])
        assert by_id["m-bad1"][1] == b"\xff not json"
        assert "arguments" in _reason(by_id["m-bad2"][0])
        # The copies of the keyless message and of the one whose id the client made up say
        # their id was not the producer's (the client gives every message it publishes one),
        # and the made-up id is refused with the reason, as oncely.brokers.rabbitmq does.
        noted = [p for p, _ in found if p.headers.get(NO_MESSAGE_ID_HEADER) == MADE_UP_NOTE]
        made_up = [p for p, _ in found if "aio-pika" in _reason(p)]
        assert len(made_up) == 1 and len(made_up[0].message_id) == 32
        trust = "pass trust_hex_message_ids=True to Idempotency"
        assert _reason(made_up[0]) == made_up_reason(made_up[0].message_id, trust)
        assert len(noted) == 2 and made_up[0] in noted
        (keyless,) = (p for p in noted if p is not made_up[0])
        assert "no producer-assigned message id" in _reason(keyless)
        for properties, _ in found:
            assert properties.headers["x-oncely-consumer"] == "billing"
        # Every result published from one key carries one id: the duplicates' replays of o1's
        # receipt are copies a downstream oncely consumer drops.
        receipts = run.taken(".receipts")
        o1 = [p.message_id for p, body in receipts if json.loads(body)["order"] == "o1"]
        assert len(o1) == 3 and len(set(o1)) == 1 and o1[0]
        assert {json.loads(body)["order"] for _, body in receipts} == {"o1", "o2", "o3"}
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r16_a_dead_letter_reason_over_frame_max_is_cut_not_fatal(tmp_path: Path) -> None:
    """A handler whose error is larger than the connection's ``frame_max`` (128 KiB by
    default; here it names an order id of 200 KB): once its retries were spent, the
    dead-letter copy's headers did not fit in one frame, RabbitMQ closed the worker's
    connection (every message on it given back), the message came back and its handler ran
    again, on and on (a classic queue has no delivery limit), never dead-lettered. The
    reason is cut to fit, as :mod:`oncely.brokers.rabbitmq` does."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        order = "big-" + "b" * 200_000
        run.charge("m-big", order, fail_times=99)
        run.worker()
        found: list[tuple[Any, bytes]] = []

        def copied() -> bool:
            found.extend(run.taken(".dead"))
            return bool(found)

        _until(copied, seconds=30, run=run)
        [(properties, _)] = found
        assert properties.message_id == "m-big"
        reason = _reason(properties)
        assert "the ledger is down (attempt for big-bbb" in reason
        assert reason.endswith("[cut to fit the server's frame_max]")
        assert run.started(order) == 3  # max_deliveries=3
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r10_on_a_quorum_queue_a_message_given_back_is_not_spent_against_its_delivery_limit(
    tmp_path: Path,
) -> None:
    """A worker is killed mid-handler on a quorum queue with ``x-delivery-limit: 3``. The
    redelivered message meets the dead worker's live lease and is given back until it lapses:
    each give-back was a requeue that RabbitMQ counted, so it dropped the message after three
    and the effect never happened. A give-back on a quorum queue is now a copy at the tail
    (with the count it had), and the original is acknowledged."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", lease=4.0)
    try:
        first = run.worker()

        def declared() -> bool:  # the app declares its quorum queue
            with run.channel() as channel, contextlib.suppress(pika.exceptions.ChannelClosed):
                channel.queue_declare(f"{run.queue}.quorum", passive=True)
                return True
            return False

        _until(declared, run=run)
        body = json.dumps({"order": "q1", "amount": 10, "sleep": 3.0}).encode()
        run.publish(body, "m-q1", queue=f"{run.queue}.quorum", content_type="application/json")
        _until(lambda: run.started("q1") == 1, run=run)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker()
        _until(lambda: run.effects("q1") == 1, seconds=60, run=run)
        time.sleep(1.0)
        assert run.effects("q1") == 1 and run.started("q1") == 2
        assert run.taken(".dead") == []
    finally:
        run.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue", ["", ".quorum"], ids=["classic", "quorum"])
def test_r8_r13_give_backs_are_not_failures_max_deliveries_counts_failed_runs(
    tmp_path: Path, queue: str
) -> None:
    """Another worker holds the message's key (a live lease, renewed) and the copy is given
    back (``in_flight``) at least 4 times; then that worker fails and releases the key, and
    every run of the copy fails. ``max_deliveries`` (3) counts the failed runs, not the
    give-backs: the copy runs 3 times, and its dead letter says it failed on all 3 (a
    classic queue's redelivery is counted by oncely's own header, which a give-back leaves
    alone; on a quorum queue a give-back is a copy keeping the count it had, so neither
    RabbitMQ's ``x-delivery-count`` nor ``x-delivery-limit`` sees it)."""
    store = f"sqlite:///{tmp_path / 'inbox.db'}"
    run = Run(store)
    body = json.dumps({"order": "g1", "amount": 1, "fail_times": 99}).encode()
    try:
        run.worker()

        def declared() -> bool:  # the app declares its quorum queue
            with run.channel() as channel, contextlib.suppress(pika.exceptions.ChannelClosed):
                channel.queue_declare(f"{run.queue}.quorum", passive=True)
                return True
            return False

        _until(declared, run=run)
        with holding(store, "m-g1", body) as fail:
            run.publish(body, "m-g1", queue=run.queue + queue, content_type="application/json")
            _until(lambda: int(run.redis.get(f"{run.ns}:given_back:m-g1") or 0) >= 4, run=run)
            assert fail().outcome is oncely.Outcome.FAILED
        dead: list[tuple[Any, bytes]] = []

        def dead_lettered() -> bool:
            dead.extend(run.taken(f"{queue}.dead"))
            return bool(dead)

        _until(dead_lettered, run=run)
        time.sleep(1.0)  # a further run or dead letter would show here
        dead.extend(run.taken(f"{queue}.dead"))
        [(properties, _)] = dead
        assert run.started("g1") == 3, _reason(properties)
        assert "failed on all 3 deliveries" in _reason(properties), _reason(properties)
        assert "the ledger is down" in _reason(properties)
        assert properties.headers["x-oncely-deliveries"] == "3"
        assert run.effects("g1") == 0
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_r13_a_message_that_kills_its_worker_every_run_is_dead_lettered_after_3_runs(
    tmp_path: Path,
) -> None:
    """The handler ends the whole worker process (``os._exit``, as the OOM killer would) on
    every run; a supervisor starts the worker again each time. RabbitMQ delivers the message
    again at once, it meets the dead run's live claim and is given back until a delivery
    takes the claim over; no run settled, so nothing counted it and it ran for ever. It runs
    ``max_deliveries`` (3) times, then is dead-lettered unrun, saying its earlier runs never
    finished."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", lease=5.0)
    try:
        run.charge("m-x1", "x1", exit_times=99)
        dead: list[tuple[Any, bytes]] = []

        def dead_lettered() -> bool:
            dead.extend(run.taken(".dead"))
            return bool(dead) or run.started("x1") > 4

        run.supervised(dead_lettered, seconds=150)
        calm = time.monotonic() + 3.0  # a further run or dead letter would show here
        run.supervised(lambda: time.monotonic() > calm)
        dead.extend(run.taken(".dead"))
        assert run.started("x1") == 3, dead
        [(properties, _)] = dead
        reason = _reason(properties)
        assert "not run again: its 3 earlier runs never finished" in reason, reason
        assert properties.headers["x-oncely-outcome"] == "rejected"
        assert run.effects("x1") == 0
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r1_a_duplicate_publishes_the_first_result_as_the_handler_returned_it(
    tmp_path: Path,
) -> None:
    """A handler that returns ``bytes``: its duplicate published the stored form (the bytes in
    base64, as text) instead of the bytes; and a duplicate whose first result was not kept
    (over ``max_result_bytes``) published an empty message under the first result's id."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        files = f"{run.queue}.files"
        run.worker()
        for order in ("f1", "f1", "huge", "huge"):  # each one, and its duplicate
            run.publish(json.dumps(order).encode(), f"m-{order}", queue=files,
                        content_type="application/json")  # fmt: skip
        copies: list[tuple[Any, bytes]] = []

        def published() -> bool:
            copies.extend(run.taken(".copies"))
            return len(copies) >= 3

        _until(published, run=run)
        time.sleep(2.0)  # a copy that would still come (the huge one's duplicate)
        copies.extend(run.taken(".copies"))
        bodies = sorted(body[:40] for _, body in copies)
        assert bodies == [b"\x00\x01 the file of f1"] * 2 + [b"x" * 40], bodies
        assert run.effects("file:f1") == 1 and run.effects("file:huge") == 1
        assert run.taken(".dead") == [] and run.taken(".files") == []  # each one acknowledged
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_r10_a_worker_killed_mid_handler_is_redelivered_and_applied_once(store: str) -> None:
    """The worker is ``SIGKILL``ed while the handler sleeps before its effect: RabbitMQ gives
    the message to the next worker, whose copy meets the dead worker's live lease (given back
    later, not dropped) and takes the claim over once the lease lapses: one effect."""
    run = Run(store, lease=2.0)
    try:
        run.charge("m-k1", "k1", sleep=4.0)
        first = run.worker()
        _until(lambda: run.started("k1") == 1, run=run)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker()
        _until(lambda: run.effects("k1") == 1, seconds=90, run=run)
        time.sleep(2.0)
        assert run.effects("k1") == 1
        assert run.started("k1") == 2  # the killed run and the one that took over
        assert run.taken(".dead") == []
    finally:
        run.close()


async def test_r1_r2_with_faststreams_test_broker_for_users_unit_tests() -> None:
    """The same middleware under ``TestRabbitBroker`` (no server): duplicates run once and
    replay the first result with one derived id (which the next subscriber drops), the test
    broker's made-up id and a reused key are dead-lettered with the reason, and a dead-letter
    subscriber is left alone."""
    from faststream.rabbit import RabbitBroker, RabbitMessage, TestRabbitBroker

    import oncely
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    broker = RabbitBroker(middlewares=[Idempotency(inbox)])
    effects: list[object] = []
    receipts: list[tuple[object, str | None]] = []
    dead: list[tuple[object, dict[str, Any]]] = []

    @broker.subscriber("orders")
    @broker.publisher("receipts")
    async def order(body: dict[str, int]) -> dict[str, int]:
        effects.append(body)
        return {"receipt": body["n"]}

    @broker.subscriber("receipts")
    async def receipt(body: dict[str, int], message: RabbitMessage) -> None:
        receipts.append((body, message.raw_message.message_id))

    @broker.subscriber("orders.dead")
    async def dead_letter(message: RabbitMessage) -> None:
        dead.append((message.body, dict(message.headers)))

    async with TestRabbitBroker(broker) as test:
        for _ in range(2):
            await test.publish({"n": 1}, "orders", message_id="m-1")
        await test.publish({"n": 2}, "orders")  # no id: the test broker makes one up
        await test.publish({"n": 3}, "orders", message_id="m-1")  # the key reused
    assert effects == [{"n": 1}]
    # The duplicate replayed the first receipt with the same derived id, and the receipts
    # subscriber, behind the same middleware, dropped the replay.
    assert [body for body, _ in receipts] == [{"receipt": 1}]
    outcomes = sorted(headers["x-oncely-outcome"] for _, headers in dead)
    assert outcomes == ["key_conflict", "rejected"]
    rejected = next(h for _, h in dead if h["x-oncely-outcome"] == "rejected")
    assert "message id" in rejected["x-oncely-reason"]


async def test_prepare_outside_faststream_run_raises_instead_of_ending_the_process() -> None:
    """FastStream's ``TestApp`` runs the start-up hooks too, but not as ``faststream run``:
    a store that does not answer is an error the test sees, not the end of its process."""
    from faststream import FastStream, TestApp
    from faststream.rabbit import RabbitBroker, TestRabbitBroker

    import oncely
    from oncely.integrations.faststream import Idempotency
    from tests.integrations.workers import down_store

    inbox = oncely.AsyncInbox(oncely.open_async(down_store()[0]), consumer="shop")
    idempotency = Idempotency(inbox)
    broker = RabbitBroker(middlewares=[idempotency])
    app = FastStream(broker, on_startup=[idempotency.prepare])
    async with TestRabbitBroker(broker):
        with pytest.raises(oncely.StoreUnavailable):
            async with TestApp(app):
                pass
    with pytest.raises(oncely.StoreUnavailable):
        await idempotency.prepare()


async def test_r2_a_broker_not_adapted_yet_is_refused_never_run_unprotected() -> None:
    from faststream.confluent import KafkaBroker, TestKafkaBroker

    import oncely
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    broker = KafkaBroker(middlewares=[Idempotency(inbox)])
    ran: list[object] = []

    @broker.subscriber("orders")
    async def order(body: dict[str, int]) -> None:
        ran.append(body)

    async with TestKafkaBroker(broker) as test:
        with pytest.raises(oncely.ConfigurationError, match="RabbitBroker"):
            await test.publish({"n": 1}, "orders")
    assert ran == []


def test_the_middleware_checks_its_settings() -> None:
    import oncely
    from oncely.integrations.faststream import Idempotency

    with pytest.raises(TypeError, match="AsyncInbox"):
        Idempotency(oncely.Inbox(oncely.open("memory://"), consumer="c"))  # type: ignore[arg-type]
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="c")
    with pytest.raises(oncely.ConfigurationError, match="max_deliveries"):
        Idempotency(inbox, max_deliveries=0)


async def test_r16_the_handlers_own_ack_and_reject_keep_their_meaning() -> None:
    """A handler that ends its message with FastStream's ``AckMessage`` completes the key (a
    copy is then a duplicate, not run); one that raises ``RejectMessage`` refuses it: the
    key is marked rejected and the message dead-lettered with the reason."""
    from faststream.exceptions import AckMessage, RejectMessage
    from faststream.rabbit import RabbitBroker, RabbitMessage, TestRabbitBroker

    import oncely
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop")
    broker = RabbitBroker(middlewares=[Idempotency(inbox)])
    ran: list[int] = []
    dead: list[dict[str, Any]] = []

    @broker.subscriber("orders")
    async def order(body: dict[str, int]) -> None:
        ran.append(body["n"])
        raise AckMessage() if body["n"] == 1 else RejectMessage()

    @broker.subscriber("orders.dead")
    async def dead_letter(message: RabbitMessage) -> None:
        dead.append(dict(message.headers))

    async with TestRabbitBroker(broker) as test:
        for _ in range(2):
            await test.publish({"n": 1}, "orders", message_id="m-1")
        for _ in range(2):
            await test.publish({"n": 2}, "orders", message_id="m-2")
    assert ran == [1, 2]
    assert [h["x-oncely-outcome"] for h in dead] == ["rejected", "rejected"]
    assert all("RejectMessage" in h["x-oncely-reason"] for h in dead)


async def test_r16_each_line_has_the_correlation_id_and_the_key_as_the_inbox_shows_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The middleware's line for each message carries its correlation id, and shows its key
    as the inbox's own lines do: with ``log_keys="hash"`` no line says the key itself."""
    from faststream.rabbit import RabbitBroker, TestRabbitBroker

    import oncely
    from oncely._core.observe import key_for_logs
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="shop", log_keys="hash")
    broker = RabbitBroker(middlewares=[Idempotency(inbox)])

    @broker.subscriber("orders")
    async def order(body: dict[str, int]) -> None:
        pass

    caplog.set_level("INFO", logger="oncely")
    async with TestRabbitBroker(broker) as test:
        for n, corr in ((1, "corr-1"), (1, "corr-2"), (2, "corr-3")):
            await test.publish(
                {"n": n}, "orders", message_id="bob@example.com", correlation_id=corr
            )
    assert "bob@example.com" not in caplog.text
    outcomes = {
        (
            r.name,
            getattr(r, "oncely_outcome", None),
            getattr(r, "oncely_key", None),
            getattr(r, "oncely_correlation_id", None),
        )
        for r in caplog.records
        if hasattr(r, "oncely_outcome")
    }
    hashed = key_for_logs("bob@example.com", "hash")
    assert outcomes == {
        ("oncely", "processed", hashed, "corr-1"),
        ("oncely", "duplicate", hashed, "corr-2"),
        ("oncely", "key_conflict", hashed, "corr-3"),
        ("oncely.faststream", "key_conflict", hashed, "corr-3"),  # with its broker action
    }


@pytest.mark.timeout(180)
def test_r1_r4_several_worker_processes_share_the_queue_each_message_once(
    store: str, tmp_path: Path
) -> None:
    """``faststream run --workers 2``: FastStream's supervisor spawns two worker processes,
    each importing the app; both start, neither is restarted, they share the queue's
    messages, and every message (each sent twice, a producer's retry) has one effect."""
    run = Run(store)
    log = tmp_path / "workers.log"
    try:
        # The app's quorum queue exists first: RabbitMQ 3.10 can fail two connections that
        # declare one new quorum queue at the same moment (INTERNAL_ERROR), which is no
        # concern of this test's.
        with run.channel() as channel:
            channel.queue_declare(
                f"{run.queue}.quorum",
                durable=True,
                arguments={"x-queue-type": "quorum", "x-delivery-limit": 3},
            )
        run.spawn("faststream", "run", f"{run.app_module}:app", "--workers", "2", log=log)
        ready = "`Charge` waiting for messages"  # in each worker's log
        _until(lambda: log.read_text(errors="replace").count(ready) >= 2, run=run)
        orders = [f"w{n}" for n in range(20)]
        for _ in range(2):  # every message, then each again (a producer's retry)
            for order in orders:
                run.charge(f"m-{order}", order, sleep=0.2)
        _until(lambda: all(run.effects(order) == 1 for order in orders), run=run)
        time.sleep(1.0)
        said = log.read_text(errors="replace")
        assert "exited with code" not in said and "Traceback" not in said, said
        assert all(run.effects(order) == 1 for order in orders)
        assert sum(run.started(order) for order in orders) == len(orders)
        assert len(run.redis.smembers(f"{run.ns}:pids")) == 2  # both processes ran some
    finally:
        run.close()


async def test_r16_a_refusal_naming_the_key_is_logged_with_it_hashed(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """With ``log_keys="hash"``, a handler's refusal whose words name the key: the inbox's
    line and the middleware's line of the message's end (its reason, a dead letter's) show
    the key hashed, on a real SQLite store."""
    from faststream.rabbit import RabbitBroker, TestRabbitBroker

    import oncely
    from oncely._core.observe import key_for_logs
    from oncely.integrations.faststream import Idempotency

    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="shop", log_keys="hash")
    broker = RabbitBroker(middlewares=[Idempotency(inbox)])
    secret = "carol@example.com"

    @broker.subscriber("orders")
    async def order(body: dict[str, int]) -> None:
        raise oncely.Reject(f"{secret} has no account")

    @broker.subscriber("orders.dead")
    async def dead(body: dict[str, int]) -> None:
        pass

    caplog.set_level("INFO", logger="oncely")
    try:
        async with TestRabbitBroker(broker) as test:
            await test.publish({"n": 1}, "orders", message_id=secret)
    finally:
        await store.aclose()
    ours = [r for r in caplog.records if r.name.startswith("oncely")]
    ended = [r for r in ours if r.name == "oncely.faststream" and hasattr(r, "oncely_outcome")]
    assert ended and all(r.oncely_outcome == "rejected" for r in ended)
    assert [r.oncely_broker_action for r in ended] == ["dead_letter"]
    for record in ours:
        fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
        text = logging.Formatter("%(message)s").format(record)
        assert secret not in f"{text} {fields}", text
    hashed = key_for_logs(secret, "hash")
    assert all(f"{hashed} has no account" in r.getMessage() for r in ended)


@pytest.mark.timeout(120)
async def test_r2_r4_an_id_the_client_made_up_is_refused_as_oncelys_rabbitmq_transport_does() -> (
    None
):
    """A real FastStream app on RabbitMQ, keyed by ``FirstOf(header, message id)``, messages
    published by aio-pika without an id (its client makes one up, ``uuid4().hex``): read as
    :mod:`oncely.brokers.rabbitmq` reads them. One carrying the header is keyed by it
    whatever its made-up id (its retry is a duplicate, run once); one without falls through
    to the made-up id and is dead-lettered, the reason naming both sources and the fixes,
    its copy keeping the id it came with and saying, in ``x-oncely-no-message-id``, that the
    id was made up (R2, R4)."""
    from faststream.rabbit import RabbitBroker

    from oncely.integrations.faststream import Idempotency

    queue = f"oncely_fixb_madeup_{os.getpid()}_{time.monotonic_ns()}"
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="billing")
    key = oncely.FirstOf(oncely.HeaderKey("x-order"), oncely.MessageIdKey())
    broker = RabbitBroker(RABBITMQ_URL, middlewares=[Idempotency(inbox, key=key)])
    ran: list[object] = []

    @broker.subscriber(queue)
    async def charge(body: dict[str, str]) -> None:
        ran.append(body)

    connection = await aio_pika.connect(RABBITMQ_URL)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)
        dead_queue = await channel.declare_queue(queue + ".dead", durable=True)
        async with broker:
            await broker.start()
            for body, headers in (
                (b'{"order": "1"}', {"x-order": "o-1"}),
                (b'{"order": "1"}', {"x-order": "o-1"}),  # the producer's retry
                (b'{"order": "2"}', None),
            ):
                message = aio_pika.Message(body, headers=headers, content_type="application/json")
                await channel.default_exchange.publish(message, routing_key=queue)
            dead: list[aio_pika.abc.AbstractIncomingMessage] = []
            for _ in range(300):
                got = await dead_queue.get(no_ack=True, fail=False)
                if got is not None:
                    dead.append(got)
                if dead and ran:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1)  # anything that would still arrive
            while (got := await dead_queue.get(no_ack=True, fail=False)) is not None:
                dead.append(got)
        assert ran == [{"order": "1"}]
        assert [m.body for m in dead] == [b'{"order": "2"}'], [m.headers for m in dead]
        (copy,) = dead
        assert copy.message_id is not None and len(copy.message_id) == 32  # kept as it came
        headers = copy.headers or {}
        assert headers["x-oncely-outcome"] == "rejected"
        assert headers[NO_MESSAGE_ID_HEADER] == MADE_UP_NOTE
        reason = str(headers["x-oncely-reason"])
        assert "'x-order' header" in reason and repr(copy.message_id) in reason, reason
        assert "aio-pika" in reason and "new_message_id()" in reason, reason
        assert "trust_hex_message_ids=True to Idempotency" in reason, reason
    finally:
        with contextlib.suppress(Exception):
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.queue_delete(queue + ".dead")
        await connection.close()
