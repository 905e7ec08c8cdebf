"""taskiq tasks behind ``oncely.integrations.taskiq``, end to end: the real ``taskiq worker``
command (worker processes) with oncely's receiver on the machine's RabbitMQ through
``taskiq-aio-pika``, the inbox on SQLite and Redis, results and effects in Redis. Duplicates,
a reused key, keyless, unparseable and unknown-task messages, failures that recover and
failures that do not, a rejection, a worker ``SIGKILL``ed mid-task, a task that ends its worker
process on every run, and a copy that meets its key running (R1, R2, R8, R10, R13, R16)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("taskiq")
pytest.importorskip("taskiq_aio_pika")
import pika

from tests.integrations.workers import (
    WorkerRun,
    assert_resends_back_off,
    holding,
    stopped_at_start,
    store_url,
    until,
)

RECEIVER = "oncely.integrations.taskiq:Receiver"


class Run(WorkerRun):
    framework = "taskiq"
    app_module = "tests.integrations.taskiq_app"
    queue_suffixes = ("", ".dead", ".letters")

    def __init__(self, store: str, lease: float = 30.0, log_keys: str = "plain") -> None:
        super().__init__(store, lease)
        self.env["ONCELY_TEST_TASKIQ_LOG_KEYS"] = log_keys
        self.app: ModuleType = self.load_app()
        self.consumers: list[object] = []
        """The ``x-oncely-consumer`` of each dead letter :meth:`dead_letters` took."""

    def worker(
        self,
        workers: int = 2,
        receiver: str = RECEIVER,
        *more: str,
        log: Path | None = None,
        loglevel: str = "WARNING",
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            "taskiq", "worker", f"{self.app_module}:broker", "--workers", str(workers),
            *(("--receiver", receiver) if receiver else ()), "--log-level", loglevel, *more,
            log=log,
        )  # fmt: skip

    def worker_starts(self) -> int:
        """How many worker processes started (taskiq starts a dead one again)."""
        return int(self.redis.get(f"{self.ns}:worker_starts") or 0)

    def dead_letters(self) -> list[tuple[str, str]]:
        """The dead-letter queue's messages (taken off it): the task name (or the body, for a
        message that names none) and its ``x-oncely-reason``."""
        found = []
        for properties, body in self.taken(".dead"):
            headers = properties.headers or {}
            name = headers.get("task_name") or body.decode(errors="replace")
            self.consumers.append(headers.get("x-oncely-consumer"))
            found.append((str(name).rsplit(":", 1)[-1], str(headers.get("x-oncely-reason"))))
        return sorted(found)

    def publish_raw(self, body: bytes) -> None:
        """What no taskiq client would send: straight onto the queue with pika."""
        with self.channel() as channel:
            channel.basic_publish("", self.queue, body, pika.BasicProperties(delivery_mode=2))

    def drive(self, scenario: Any) -> Any:
        """Run ``scenario(app)`` with the app's broker started as a client."""

        async def main() -> Any:
            await self.app.broker.startup()
            try:
                return await scenario(self.app)
            finally:
                await self.app.broker.shutdown()

        return asyncio.run(main())


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url(request, tmp_path, "oncely_tqi")


async def _value(task: Any) -> Any:
    return (await task.wait_result(timeout=60)).return_value


@pytest.mark.timeout(180)
def test_r1_r2_r16_each_effect_once_and_every_refusal_dead_lettered_with_its_reason(
    store: str,
) -> None:
    from oncely.integrations.taskiq import send_with_key

    run = Run(store)
    try:
        run.worker()

        async def scenario(app: ModuleType) -> list[str]:
            first = [await app.charge.kiq("o1", 10) for _ in range(3)]  # a producer's retries
            assert [await _value(t) for t in first] == [{"order": "o1", "amount": 10}] * 3
            for _ in range(2):
                await send_with_key(app.notify, "mail:o1", "o1")
            recovered = await app.charge.kiq("o3", 10, fail_times=2)
            assert await _value(recovered) == {"order": "o3", "amount": 10}
            refused = [
                await app.charge.kiq("o1", 99),  # the key again, other arguments
                await app.notify.kiq("o9"),  # no key
                await app.charge.kiq("o4", 10, fail_times=99),  # never succeeds
                await app.charge.kiq("o5", 10, reject=True),  # the task refuses it
            ]
            errors = []
            for task in refused:
                result = await task.wait_result(timeout=60)
                assert result.is_err, result
                errors.append(str(result.error))
            await app.plain.kiq("p1")
            return errors

        errors = run.drive(scenario)
        assert "key_conflict" in errors[0] and "no idempotency key" in errors[1]
        assert "failed on all 3 deliveries" in errors[2] and "not billable" in errors[3]
        # After its retries a message is dead-lettered as rejected, as every consumer says it.
        assert "rejected: failed on all" in errors[2], errors[2]
        run.publish_raw(b"\xff{ not a taskiq message")  # taskiq alone acks it: gone
        gone = {"task_id": "t-gone", "task_name": "billing:gone", "labels": {}, "args": [],
                "kwargs": {}}  # fmt: skip
        run.publish_raw(json.dumps(gone).encode())
        letters: list[tuple[str, str]] = []

        def drained() -> bool:
            letters.extend(run.dead_letters())
            return len(letters) >= 6 and run.effects("mail:o1") == 1

        until(drained, client=run.redis, ns=run.ns)
        time.sleep(1.0)  # anything that would still arrive (a second dead letter of one)
        letters.extend(run.dead_letters())
        assert run.effects("o1") == 1 and run.effects("o3") == 1 and run.effects("mail:o1") == 1
        assert run.effects("mail:o9") == 0 and run.effects("o4") == 0 and run.effects("o5") == 0
        assert run.effects("plain:p1") == 1
        assert run.started("o3") == 3 and run.started("o4") == 3
        names = sorted(name for name, _ in letters)
        bad = "\ufffd{ not a taskiq message"
        assert names == ["charge", "charge", "charge", "gone", "notify", bad], letters
        reasons = dict(letters)
        assert "could not parse" in reasons[bad]
        assert "no task 'billing:gone'" in reasons["gone"]
        # Every dead letter names the inbox's consumer, the two no inbox saw included (they
        # named none: an empty x-oncely-consumer).
        assert run.consumers == ["billing"] * 6
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_worker_killed_mid_task_is_redelivered_and_applied_once(store: str) -> None:
    """The worker is ``SIGKILL``ed (every process) while the task sleeps before its effect:
    RabbitMQ gives the message to the next worker, whose copy meets the dead worker's live
    lease, is sent again, and takes the claim over once the lease lapses: one effect."""
    run = Run(store, lease=2.0)
    try:

        async def send(app: ModuleType) -> str:
            return str((await app.charge.kiq("k1", 10, sleep=4.0)).task_id)

        task_id = run.drive(send)
        first = run.worker(workers=1)
        until(lambda: run.started("k1") == 1, client=run.redis, ns=run.ns)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker(workers=1)

        async def result(app: ModuleType) -> Any:
            return (await app.broker.result_backend.get_result(task_id)).return_value

        until(lambda: run.effects("k1") == 1, seconds=90, client=run.redis, ns=run.ns)
        time.sleep(2.0)
        assert run.effects("k1") == 1 and run.started("k1") == 2
        assert run.drive(result) == {"order": "k1", "amount": 10}
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r1_a_sync_task_sent_with_a_timeout_runs_once(tmp_path: Path) -> None:
    """taskiq cannot stop a sync task's thread at its timeout: the thread ran on while the
    claim was given back, and each retry ran the task again beside it (three effects, and the
    caller told it failed). The timeout label of a keyed sync task is now ignored."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        run.worker(workers=1)

        async def scenario(app: ModuleType) -> Any:
            sent = await app.ship.kicker().with_labels(timeout=0.3).kiq("s1", 1.5)
            return await sent.wait_result(timeout=60)

        result = run.drive(scenario)
        assert not result.is_err and result.return_value == "s1", result
        time.sleep(3.0)  # a retry beside it would have ended by now
        assert run.effects("ship:s1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r1_a_task_that_requeues_itself_runs_again_and_one_that_rejects_itself_is_not(
    tmp_path: Path,
) -> None:
    """taskiq's ``Context.requeue()`` sends the task again and ends it with NoResultError:
    the claim was completed as if the task were done, so the copy was answered as a
    duplicate (``None``) and the task never ran (its work lost). ``Context.reject()`` was
    retried as a failure; it is poison, dead-lettered at once."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        run.worker(workers=1)

        async def scenario(app: ModuleType) -> list[Any]:
            requeued = await app.later.kiq("r1")
            rejected = await app.later.kiq("bad1")
            return [await t.wait_result(timeout=60) for t in (requeued, rejected)]

        requeued, rejected = run.drive(scenario)
        assert not requeued.is_err and requeued.return_value == "r1", requeued
        assert run.effects("r1") == 1 and run.started("r1") == 2
        assert rejected.is_err and "rejected itself" in str(rejected.error), rejected
        assert run.started("bad1") == 1 and run.effects("bad1") == 0
        assert run.dead_letters() == [("later", "the task rejected itself")]
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_dead_letter_keeps_label_names_over_128_bytes_whole(tmp_path: Path) -> None:
    """A dead letter carries the task's labels as AMQP headers. aio-pika's encoder cut every
    header name at 128 bytes: two labels whose names share their first 128 bytes became one
    header of the dead letter, a value lost. AMQP carries names of up to 255 bytes whole."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    labels = {"l" * 128 + "_first": "1", "l" * 128 + "_second": "2"}
    try:
        run.worker(workers=1)

        async def scenario(app: ModuleType) -> Any:
            sent = await app.notify.kicker().with_labels(**labels).kiq("o9")  # no key
            return await sent.wait_result(timeout=60)

        assert run.drive(scenario).is_err
        letters: list[tuple[Any, bytes]] = []

        def arrived() -> bool:
            letters.extend(run.taken(".dead"))
            return len(letters) >= 1

        until(arrived, client=run.redis, ns=run.ns)
        headers = letters[0][0].headers
        assert "no idempotency key" in headers["x-oncely-reason"], headers
        assert labels.items() <= headers.items(), headers
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r20_dead_letters_reach_a_dead_letter_queue_named_on_the_middleware(
    tmp_path: Path,
) -> None:
    """``Idempotency(dead_letter_queue=...)`` names a queue nothing declared: RabbitMQ dropped
    every dead letter sent there (the log said it was in that queue). It is declared before
    the first one."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    run.env["ONCELY_TEST_TASKIQ_LETTERS"] = f"{run.queue}.letters"
    try:
        run.worker(workers=1)

        async def scenario(app: ModuleType) -> Any:
            return await (await app.notify.kiq("o9")).wait_result(timeout=60)  # no key

        keyless = run.drive(scenario)
        assert keyless.is_err and f"{run.queue}.letters" in str(keyless.error), keyless
        letters: list[tuple[Any, bytes]] = []

        def arrived() -> bool:
            letters.extend(run.taken(".letters"))
            return len(letters) >= 1

        until(arrived, client=run.redis, ns=run.ns)
        headers = letters[0][0].headers
        assert "no idempotency key" in headers["x-oncely-reason"], headers
        assert run.taken(".dead") == [] and run.effects("mail:o9") == 0
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r2_a_key_sent_with_send_with_key_that_oncely_refuses_answers_its_caller(
    tmp_path: Path,
) -> None:
    """``send_with_key`` with a key over the inbox's limit: the message was dead-lettered, but
    no result was ever stored for it (its task id comes from the key, and a refusal under
    such an id was taken for a copy of a first message whose result stands), so the caller
    waited for one until its timeout."""
    from taskiq.exceptions import TaskiqResultTimeoutError

    from oncely.integrations.taskiq import send_with_key

    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    try:
        run.worker(workers=1)

        async def scenario(app: ModuleType) -> Any:
            sent = await send_with_key(app.notify, "mail:" + "x" * 600, "o1")
            try:
                return await sent.wait_result(timeout=20)
            except TaskiqResultTimeoutError:
                return None

        result = run.drive(scenario)
        assert result is not None, "the caller got no answer"
        assert result.is_err and "over the limit" in str(result.error), result
        assert run.effects("mail:o1") == 0
        assert [name for name, _ in run.dead_letters()] == ["notify"]
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_worker_whose_store_is_down_stops_before_taking_a_message(tmp_path: Path) -> None:
    # Before, each worker process started and sent every task again every 2 s until the
    # store answered. taskiq starts a stopped worker process again: --max-fails ends it.
    async def send(app: ModuleType) -> None:
        await app.charge.kiq("u1", 10)

    stopped_at_start(
        Run,
        lambda run: run.drive(send),
        lambda run, log: run.worker(1, RECEIVER, "--max-fails", "1", log=log),
        tmp_path / "worker.log",
        code=None,
    )


@pytest.mark.timeout(120)
def test_r2_a_worker_without_oncelys_receiver_refuses_to_start(store: str) -> None:
    """Keyed tasks never run unprotected: the middleware stops a worker that runs taskiq's
    own receiver, which would run them without a claim."""
    run = Run(store)
    try:

        async def send(app: ModuleType) -> None:
            await app.charge.kiq("u1", 10)

        run.drive(send)
        worker = run.worker(workers=1, receiver="")
        time.sleep(8.0)
        assert run.started("u1") == 0
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
        run.worker(workers=1)  # the right worker then runs it, once
        until(lambda: run.effects("u1") == 1, client=run.redis, ns=run.ns)
    finally:
        run.close()


async def test_r1_r2_with_taskiqs_in_memory_broker_for_users_unit_tests() -> None:
    """A user's unit test on taskiq's ``InMemoryBroker``: the same claims, no worker, no
    server; refusals go to the ``dead_letter`` function the test gives."""
    from taskiq import InMemoryBroker

    import oncely
    from oncely.integrations.taskiq import Idempotency, send_with_key
    from oncely.testing import AsyncMemoryStore

    effects: list[str] = []
    letters: list[dict[str, Any]] = []

    async def keep(body: bytes, headers: Any) -> None:
        letters.append(dict(headers))

    inbox = oncely.AsyncInbox(AsyncMemoryStore(), consumer="billing")
    broker = InMemoryBroker(await_inplace=True).with_middlewares(
        Idempotency(inbox, dead_letter=keep, retry_delay=0)
    )

    @broker.task(idempotency_key=lambda order, amount: f"charge:{order}")
    async def charge(order: str, amount: int) -> int:
        effects.append(order)
        return amount

    @broker.task(idempotency_key="sent")
    async def notify(order: str) -> None:
        effects.append(f"mail:{order}")

    await broker.startup()
    try:
        sent = [await charge.kiq("o1", 10) for _ in range(3)]
        assert [(await t.wait_result()).return_value for t in sent] == [10, 10, 10]
        await send_with_key(notify, "mail:o1", "o1")
        await send_with_key(notify, "mail:o1", "o1")
        conflict = await charge.kiq("o1", 99)
        keyless = await notify.kiq("o2")
        assert (await conflict.wait_result()).is_err and (await keyless.wait_result()).is_err
        # send_with_key's task id comes from the key: a resend with other arguments is
        # dead-lettered without writing over the first message's result (it did before).
        first = await send_with_key(charge, "charge:o7", "o7", 1)
        assert (await first.wait_result()).return_value == 1
        await send_with_key(charge, "charge:o7", "o7", 2)
        again = await first.wait_result()
        assert not again.is_err and again.return_value == 1
    finally:
        await broker.shutdown()
    assert effects == ["o1", "mail:o1", "o7"]
    assert [letter["x-oncely-outcome"] for letter in letters] == [
        "key_conflict",
        "rejected",
        "key_conflict",
    ]
    assert "no idempotency key" in letters[1]["x-oncely-reason"]


async def test_the_middleware_and_the_receiver_check_their_settings() -> None:
    from taskiq import InMemoryBroker

    import oncely
    from oncely import ConfigurationError
    from oncely.integrations.taskiq import Idempotency, Receiver
    from oncely.testing import AsyncMemoryStore, MemoryStore

    inbox = oncely.AsyncInbox(AsyncMemoryStore(), consumer="billing")
    with pytest.raises(ConfigurationError, match="AsyncInbox"):
        Idempotency(oncely.Inbox(MemoryStore(), consumer="billing"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=">= 0"):
        Idempotency(inbox, max_retries=-1)
    with pytest.raises(ConfigurationError, match="with_middlewares"):
        Receiver(InMemoryBroker())
    broker = InMemoryBroker().with_middlewares(Idempotency(inbox, dead_letter=None))
    with pytest.raises(ConfigurationError, match="dead_letter"):
        await broker.startup()
    timed = InMemoryBroker().with_middlewares(Idempotency(inbox, dead_letter=lambda *_: None))

    @timed.task(idempotency_key=lambda order: order, timeout=1)
    def sync_with_timeout(order: str) -> None: ...

    with pytest.raises(ConfigurationError, match="timeout cannot go with idempotency_key"):
        await timed.startup()
    from taskiq.acks import AcknowledgeType

    with pytest.raises(ConfigurationError, match="when_received"):
        Receiver(broker, ack_type=AcknowledgeType.WHEN_RECEIVED)
    # taskiq's own retries turn a failure into NoResultError: it read as a task that ended,
    # the key recorded as done and the retry copies answered as duplicates (never run).
    from taskiq.middlewares import SimpleRetryMiddleware, SmartRetryMiddleware

    async def keep(message: bytes, headers: dict[str, str]) -> None:
        return None

    for retrying in (SimpleRetryMiddleware(default_retry_count=3), SmartRetryMiddleware()):
        broker = InMemoryBroker().with_middlewares(Idempotency(inbox, dead_letter=keep), retrying)
        with pytest.raises(ConfigurationError, match="NoResultError"):
            await broker.startup()


@pytest.mark.timeout(300)
def test_r10_a_task_that_kills_its_worker_process_every_time_is_dead_lettered(store: str) -> None:
    """``fatal`` ends its worker process on every run (``os._exit``, as the OOM killer
    would); the ``taskiq worker`` command starts the process again each time. taskiq sees no
    failure: RabbitMQ gives the message to the next process, which died again, for ever, and
    the caller never got an answer. Now the runs are counted by the inbox (each copy takes
    the dead run's claim over once its 2 s lease lapsed, one attempt higher): after
    ``max_retries`` + 1 (3) runs that never finished, the message is dead-lettered with that
    reason instead of run again, the caller gets the error, and the worker stays up. A task
    that dies once runs again and succeeds."""
    run = Run(store, lease=2.0)
    try:
        worker = run.worker(workers=1)

        async def doomed(app: ModuleType) -> Any:
            return await (await app.fatal.kiq("w1", deaths=99)).wait_result(timeout=90)

        result = run.drive(doomed)
        assert result.is_err, result
        assert "rejected: failed on all 3 deliveries; last: none of its 3 runs finished (the " \
            "worker" in str(result.error), result  # fmt: skip
        assert run.started("fatal:w1") == 3 and run.effects("fatal:w1") == 0
        # The first process and one after each death, at least: taskiq's process manager
        # may start one again more than once for a death (its queue of restarts is read
        # behind a feeder thread, and a late second restart terminates the new process), so
        # the runs and effects above are what is counted exactly.
        starts = run.worker_starts()
        assert starts >= 4, starts

        async def charged(app: ModuleType) -> Any:
            return await _value(await app.charge.kiq("w0", 10))

        assert run.drive(charged) == {"order": "w0", "amount": 10}
        assert run.worker_starts() == starts and worker.poll() is None
        [(properties, _)] = run.taken(".dead")
        headers = properties.headers
        assert headers["task_name"].endswith(":fatal"), headers
        assert "none of its 3 runs finished" in headers["x-oncely-reason"], headers
        assert headers["x-oncely-outcome"] == "rejected", headers
        assert str(headers["x-oncely-deliveries"]) == "3", headers

        async def survivor(app: ModuleType) -> Any:
            return await _value(await app.fatal.kiq("w2", deaths=1))

        assert run.drive(survivor) == "w2"
        assert run.started("fatal:w2") == 2 and run.effects("fatal:w2") == 1
        assert run.worker_starts() >= starts + 1
        assert run.dead_letters() == []
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_r10_a_copy_sent_again_runs_only_once_the_one_it_came_from_is_acknowledged(
    tmp_path: Path,
) -> None:
    """A copy of ``fatal`` meets its key held (by this test) and is sent again, then
    acknowledged; the key is let go meanwhile. The copy sent again came back to the same
    worker process at once and could run before that acknowledgement went out (the app's
    ``SlowAcks`` makes sure it would): its run ended the process, so RabbitMQ handed out the
    unacknowledged copy again too. Two copies of one message from then on: after three runs
    the first was dead-lettered, its key given back, and the second ran the task three more
    times (three more deaths, a second dead letter). The copy now waits for that
    acknowledgement: three runs, one dead letter."""
    store = f"sqlite:///{tmp_path / 'inbox.db'}"
    run = Run(store, lease=2.0)
    run.env["ONCELY_TEST_TASKIQ_SLOW_ACKS"] = "1"
    log = tmp_path / "worker.log"
    body = json.dumps({"args": ["w5"], "kwargs": {"deaths": 99}}).encode()
    try:
        run.worker(workers=1, log=log, loglevel="INFO")
        with holding(store, "fatal:w5", body) as fail:

            async def send(app: ModuleType) -> str:
                return str((await app.fatal.kiq("w5", deaths=99)).task_id)

            task_id = run.drive(send)
            said = "key fatal:w5 is being processed elsewhere"
            run.until(lambda: said in log.read_text(errors="replace"))
            fail()

        async def result(app: ModuleType) -> Any:
            from taskiq import AsyncTaskiqTask

            return await AsyncTaskiqTask(task_id, app.broker.result_backend).wait_result(
                timeout=120
            )

        answer = run.drive(result)
        assert answer.is_err and "none of its 3 runs finished" in str(answer.error), answer

        async def charged(app: ModuleType) -> Any:
            return await _value(await app.charge.kiq("w0", 10))

        assert run.drive(charged) == {"order": "w0", "amount": 10}
        # A second copy shows at once: it meets the run that gives up (in flight, attempt 4),
        # or runs the task again after it.
        met = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if "in_flight" in line and "key=fatal:w5 attempt=4" in line
        ]
        assert met == [], met
        assert run.started("fatal:w5") == 3 and run.effects("fatal:w5") == 0
        assert [name for name, _ in run.dead_letters()] == ["fatal"]
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r8_a_copy_that_meets_its_key_running_is_sent_again_less_and_less_often(
    tmp_path: Path,
) -> None:
    """A copy of ``charge`` (``retry_in_flight=1``) meets the first still running (12 s).
    Before, it was sent again every second: a dozen resends here, 1,800 for an hour-long
    task. Now each wait is twice the last (1, 2, 4, 8 s: four resends while the first ran),
    up to what is left of the running claim's lease; the copy still ends as the duplicate
    of the one run, with its result."""
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    log = tmp_path / "worker.log"
    try:
        run.worker(workers=1, log=log, loglevel="INFO")

        async def scenario(app: ModuleType) -> list[Any]:
            first = await app.charge.kiq("s1", 10, sleep=12.0)
            while run.started("s1") < 1:
                await asyncio.sleep(0.2)
            copy = await app.charge.kiq("s1", 10, sleep=12.0)
            return [(await t.wait_result(timeout=90)).return_value for t in (first, copy)]

        assert run.drive(scenario) == [{"order": "s1", "amount": 10}] * 2
        assert_resends_back_off(log, "charge:s1")
        assert run.effects("s1") == 1 and run.started("s1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r16_with_log_keys_hash_no_line_of_the_worker_says_a_key(tmp_path: Path) -> None:
    """An inbox made with ``log_keys="hash"`` (keys that are personal data): the worker's
    lines show each key as the inbox shows it, its digest, on every path that names one (a
    copy met running and sent again, a duplicate, a failure retried, a rejection
    dead-lettered). Before, the receiver's line for a copy sent again said the key itself."""
    from oncely._core.observe import key_for_logs

    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", log_keys="hash")
    log = tmp_path / "worker.log"
    try:
        run.worker(workers=1, log=log, loglevel="INFO")

        async def scenario(app: ModuleType) -> None:
            first = await app.charge.kiq("h1", 10, sleep=3.0)
            while run.started("h1") < 1:
                await asyncio.sleep(0.2)
            copy = await app.charge.kiq("h1", 10, sleep=3.0)  # sent again, then a duplicate
            failed = await app.charge.kiq("h2", 10, fail_times=1)  # fails, then retried
            await app.charge.kiq("h3", 10, reject=True)  # dead-lettered
            for task in (first, copy, failed):
                await _value(task)

        run.drive(scenario)
        run.until(lambda: len(run.dead_letters()) == 1)
        time.sleep(0.5)  # the worker's last lines reach its log
        said = log.read_text(errors="replace")
        for key in ("charge:h1", "charge:h2", "charge:h3"):
            assert key not in said, said
            assert key_for_logs(key, "hash") in said, (key, said)
        assert f"key {key_for_logs('charge:h1', 'hash')} is being processed elsewhere" in said
    finally:
        run.close()


async def test_r16_a_dead_letter_s_line_shows_a_key_named_in_its_reason_hashed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``log_keys="hash"``, a refusal or a failure whose words name the key (here the
    task's own ``Reject`` and error) is logged with the key hashed, on a real SQLite store;
    the dead letter itself keeps its reason as it is (``x-oncely-reason``: it travels with
    the message, whose key is in it anyway)."""
    from taskiq import InMemoryBroker

    import oncely
    from oncely._core.observe import key_for_logs
    from oncely.integrations.taskiq import Idempotency

    letters: list[dict[str, Any]] = []

    async def keep(body: bytes, headers: Any) -> None:
        letters.append(dict(headers))

    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="billing", log_keys="hash")
    broker = InMemoryBroker(await_inplace=True).with_middlewares(
        Idempotency(inbox, dead_letter=keep, retry_delay=0, max_retries=0)
    )

    @broker.task(idempotency_key=lambda order: f"charge:{order}")
    async def charge(order: str) -> None:
        if order == "o1":
            raise oncely.Reject(f"charge:{order} is not billable")
        raise RuntimeError(f"the ledger refused charge:{order}")

    caplog.set_level(logging.INFO, logger="oncely")
    await broker.startup()
    try:
        for order in ("o1", "o2"):
            assert (await (await charge.kiq(order)).wait_result()).is_err
    finally:
        await broker.shutdown()
        await store.aclose()
    ours = [r for r in caplog.records if r.name.startswith("oncely")]
    dead = [r.getMessage() for r in ours if "dead-lettered" in r.getMessage()]
    assert len(dead) == 2, [r.getMessage() for r in ours]
    for record in ours:
        text = logging.Formatter("%(message)s").format(record)
        assert "charge:o1" not in text and "charge:o2" not in text, text
    assert f"{key_for_logs('charge:o1', 'hash')} is not billable" in dead[0]
    assert f"the ledger refused {key_for_logs('charge:o2', 'hash')}" in dead[1]
    assert [letter["x-oncely-reason"] for letter in letters] == [
        "charge:o1 is not billable",
        "failed on all 1 deliveries; last: RuntimeError: the ledger refused charge:o2",
    ]
