"""``manage.py oncely consume`` as a Django user runs it: the real worker process of a Django
project on PostgreSQL, reading a RabbitMQ queue, with a plain ``def`` handler that writes a
``Charge`` row through the ORM. Each message's record and the handler's row commit in one
``transaction.atomic()`` (R7), so a duplicate, a retry after a failure and a worker killed
mid-handler all end with one row, and nothing the worker cannot process is dropped: it is
dead-lettered with its reason (R2, R3, R9, R11, R12)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.brokers.common import remove_destinations, unique
from tests.brokers.foreign import publish_amqp
from tests.services import POSTGRES_DSN, RABBITMQ_URL, REDIS_URL, require

pytest.importorskip("django")
aio_pika = pytest.importorskip("aio_pika")

PROJECT = Path(__file__).parent / "django_project"
SRC = Path(__file__).resolve().parents[2] / "src"
REDIS_DB = REDIS_URL.rsplit("/", 1)[0] + "/15"


class Project:
    """The test project on a database of its own, its worker's environment and helpers."""

    def __init__(self, database: str, source: str, ns: str, log: Path) -> None:
        self.log = log
        self.database = database
        self.source = source
        self.ns = ns
        self.env = {
            **os.environ,
            "ONCELY_TEST_DJANGO_DB": f"postgresql:{POSTGRES_DSN.rsplit('/', 1)[0]}/{database}",
            "ONCELY_TEST_DJANGO_NS": ns,
            "ONCELY_TEST_REDIS_URL": REDIS_DB,
            "PYTHONPATH": os.pathsep.join([str(SRC), str(PROJECT)]),
            "DJANGO_SETTINGS_MODULE": "site_config.settings",
        }
        self.redis = redis.Redis.from_url(REDIS_DB)

    def manage(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *argv],
            cwd=PROJECT, env=self.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    def worker(self, *extra: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "manage.py", "oncely", "consume", "--broker", RABBITMQ_URL,
            "--source", self.source, "--handler", "shop.handlers:charge",
            "--consumer", "billing", "--concurrency", "4", "--max-deliveries", "3",
            "--log-format", "json", *extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            return subprocess.Popen(argv, cwd=PROJECT, env=self.env, stdout=log, stderr=log)

    def lines(self) -> list[dict[str, Any]]:
        """The workers' JSON log lines so far."""
        text = self.log.read_text(errors="replace")
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def wait(self, what: Callable[[], bool], seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not what():
            if time.monotonic() > deadline:
                raise AssertionError("timed out; the worker's log:\n" + self.log.read_text())
            time.sleep(0.2)

    def charges(self) -> dict[str, int]:
        with psycopg.connect(self.dsn) as conn:
            found = conn.execute(
                'SELECT "order", count(*) FROM shop_charge GROUP BY "order"'
            ).fetchall()
        return {str(order): int(n) for order, n in found}

    @property
    def dsn(self) -> str:
        return f"{POSTGRES_DSN.rsplit('/', 1)[0]}/{self.database}"

    def starts(self, order: str) -> int:
        return int(self.redis.get(f"{self.ns}:started:{order}") or 0)

    def publish(self, messages: list[tuple[str, bytes]]) -> None:
        """Publish as any producer does (pika, confirmed); "" sends no message id at all,
        which oncely's own producer refuses to do."""
        asyncio.run(
            publish_amqp(
                self.source, [(body, {"message_id": mid or None}) for mid, body in messages]
            )
        )

    def counts(self, queue: str) -> tuple[int, int]:
        """(messages ready, consumers) of ``queue``; (0, 0) while it does not exist."""

        async def declare() -> tuple[int, int]:
            connection = await aio_pika.connect(RABBITMQ_URL)
            async with connection:
                channel = await connection.channel()
                try:
                    found = await channel.declare_queue(queue, passive=True)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    return 0, 0
                result = found.declaration_result
                return result.message_count or 0, result.consumer_count or 0

        return asyncio.run(declare())

    def reading(self) -> bool:
        return self.counts(self.source)[1] >= 1

    def dead_count(self) -> int:
        return self.counts(f"{self.source}.dead")[0]

    def dead_letters(self) -> list[dict[str, Any]]:
        async def drain() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = []
            connection = await aio_pika.connect(RABBITMQ_URL)
            async with connection:
                channel = await connection.channel()
                queue = await channel.declare_queue(f"{self.source}.dead", passive=True)
                while (message := await queue.get(fail=False)) is not None:
                    await message.ack()
                    found.append(
                        {"id": message.message_id or "", "body": message.body, **message.headers}
                    )
            return found

        return asyncio.run(drain())


def _order(name: str, **extra: object) -> bytes:
    return json.dumps({"order": name, **extra}).encode()


def _stop(worker: subprocess.Popen[bytes]) -> int:
    worker.send_signal(signal.SIGTERM)
    return worker.wait(timeout=60)


@pytest.mark.parametrize(
    ("handler", "extra", "says"),
    [
        ("shop.handlers:not_sync", [], "must be a plain function, def handler(payload)"),
        ("shop.handlers:charge", ["--key", "delivery-tag"], "R4"),
        ("shop.handlers:missing", [], "has no 'missing'"),
        # Written for `oncely consume --mode transactional`: it would start and dead-letter
        # every message with the TypeError; it is refused as `oncely consume` refuses it.
        (
            "shop.handlers:charge_in",
            [],
            "'shop.handlers:charge_in' takes (tx, order), but manage.py oncely consume calls "
            "it as handler(payload): write it as def charge_in(payload)",
        ),
    ],
)
def test_the_worker_refuses_an_async_or_misfit_handler_and_a_transport_id_as_key(
    handler: str, extra: list[str], says: str, tmp_path: Path
) -> None:
    """Refused before the worker starts, exit 2 (a usage error), naming the fix."""
    project = Project("unused", "q", "ns", tmp_path / "worker.log")
    project.env["ONCELY_TEST_DJANGO_DB"] = f"sqlite:{tmp_path / 'shop.db'}"
    done = project.manage(
        "oncely", "consume", "--broker", "amqp://127.0.0.1:1/", "--source", "q",
        "--consumer", "billing", "--handler", handler, *extra,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    require("PostgreSQL", POSTGRES_DSN, 5432)
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    database = f"oncely_dj_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    made = Project(database, unique("django_consume"), unique("oncely_dj"), tmp_path / "worker.log")
    try:
        done = made.manage("migrate", "--noinput")
        assert done.returncode == 0, done.stdout + done.stderr
        yield made
    finally:
        for key in made.redis.scan_iter(f"{made.ns}:*"):
            made.redis.delete(key)
        asyncio.run(remove_destinations(RABBITMQ_URL, made.source))
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


@pytest.mark.services
@pytest.mark.slow
def test_r7_the_django_worker_charges_each_order_once_and_dead_letters_what_it_cannot_run(
    project: Project,
) -> None:
    worker = project.worker()
    try:
        project.wait(project.reading)
        project.publish(
            [
                ("a", _order("A")),
                ("a", _order("A")),  # a producer retry (R3)
                ("a", _order("A")),
                ("b", _order("B")),
                ("b", _order("B", amount=9)),  # the id reused for another order (R11)
                ("", _order("K")),  # no key (R2)
                ("u", b"\xff not json"),  # undecodable (R12)
                ("f", _order("F", fail_times=2)),  # fails twice, then succeeds (R9)
                ("p", _order("P", fail_times=99)),  # fails every time: dead-lettered
                ("r", _order("R", reject=True)),  # the handler rejects it
            ]
        )
        project.wait(lambda: project.starts("F") >= 3 and project.starts("P") >= 3, 90)
        project.wait(lambda: project.dead_count() >= 5, 60)
        time.sleep(2)  # let in-flight copies of A settle as duplicates
    finally:
        code = _stop(worker)
    lines = project.lines()
    assert code == 0, lines
    # One row per order that succeeded, whatever the copies and failed attempts: a failed
    # attempt's row rolled back with its claim (R7).
    assert project.charges() == {"A": 1, "B": 1, "F": 1}
    assert project.starts("A") == 1 and project.starts("B") == 1
    assert project.starts("F") == 3 and project.starts("P") == 3
    dead = {letter["body"]: letter for letter in project.dead_letters()}
    keyless, conflict = dead.pop(_order("K")), dead.pop(_order("B", amount=9))
    undecodable, poison = dead.pop(b"\xff not json"), dead.pop(_order("P", fail_times=99))
    rejected = dead.pop(_order("R", reject=True))
    assert dead == {}, dead
    assert conflict["id"] == "b" and conflict["x-oncely-outcome"] == "key_conflict"
    assert keyless["x-oncely-outcome"] == "rejected", keyless
    assert "message id" in str(keyless["x-oncely-reason"]), keyless
    assert undecodable["id"] == "u" and undecodable["x-oncely-outcome"] == "rejected"
    assert "not JSON" in str(undecodable["x-oncely-reason"])
    assert poison["id"] == "p" and poison["x-oncely-outcome"] == "rejected"
    assert poison["x-oncely-reason"] == (
        "failed on all 3 deliveries; last: handler raised RuntimeError: the ledger is down "
        "(start 3)"
    )
    assert rejected["id"] == "r" and rejected["x-oncely-outcome"] == "rejected"
    assert "not an order of ours" in str(rejected["x-oncely-reason"])
    outcomes = [line["outcome"] for line in lines if "broker_action" in line]
    assert outcomes.count("processed") == 3 and outcomes.count("duplicate") >= 1, outcomes
    assert any("oncely consume stopped" in line["message"] for line in lines)
    # The records live in the project's database, next to the rows.
    stats = project.manage("oncely", "inbox", "list", "--consumer", "billing", "--json")
    assert stats.returncode == 0, stats.stderr
    listed = json.loads(stats.stdout)
    assert {"a", "b", "f"} <= {record["key"] for record in listed["records"]}, listed


@pytest.mark.services
@pytest.mark.slow
def test_r7_a_worker_killed_mid_handler_leaves_no_row_and_the_redelivery_charges_once(
    project: Project,
) -> None:
    worker = project.worker()
    try:
        project.wait(project.reading)
        project.publish([("k", _order("K", sleep=30))])
        project.wait(lambda: project.starts("K") == 1)
        time.sleep(0.5)  # the row is written, uncommitted, while the handler sleeps
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert project.charges() == {}  # the uncommitted row died with the worker
    worker = project.worker()
    try:
        project.wait(project.reading)
        project.publish([("k2", _order("K2"))])  # proves the new worker is reading
        project.wait(lambda: project.charges().get("K2") == 1)
        # RabbitMQ gave the killed worker's message back; its claim never committed, so the
        # new worker runs it from the start (the handler sleeps 30 s again).
        project.wait(lambda: project.charges().get("K") == 1, 90)
    finally:
        code = _stop(worker)
    lines = project.lines()
    assert code == 0, lines
    assert project.starts("K") == 2
    assert project.charges() == {"K": 1, "K2": 1}
