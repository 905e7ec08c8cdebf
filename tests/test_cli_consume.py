"""``oncely consume`` as a user runs it: a real broker, a handler given as module:function, one
log line per outcome, and a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from oncely.brokers import open_producer
from tests.backends.mysql import drop_tables
from tests.brokers.common import free_port, remove_destinations, unique
from tests.brokers.foreign import wait_for_queue
from tests.services import MYSQL_URL, RABBITMQ_URL, REDIS_URL, require

ROOT = Path(__file__).resolve().parent.parent
ONCELY = [sys.executable, "-m", "oncely.cli"]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ONCELY, *args], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )


def _consume_until_sigterm(
    command: list[str], meanwhile: Callable[[], None], env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``oncely consume`` (``command``), call ``meanwhile`` while it runs, stop it with
    SIGTERM; its exit code and stderr (killed if it did not stop within 30 s)."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        meanwhile()
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def test_consume_refuses_a_transport_id_as_key_and_a_sync_handler() -> None:
    base = ["consume", "--broker", "amqp://localhost/", "--source", "q", "--consumer", "c"]
    done = _run([*base, "--handler", "tests.brokers.handlers:record", "--key", "delivery-tag"])
    assert done.returncode == 2 and "R4" in done.stderr
    done = _run([*base, "--handler", "tests.brokers.handlers:not_async"])
    assert done.returncode == 2 and "must be an async function" in done.stderr
    done = _run([*base, "--handler", "tests.brokers.handlers:missing"])
    assert done.returncode == 2 and "has no 'missing'" in done.stderr
    done = _run([*base, "--handler", "record"])
    assert done.returncode == 2 and "module:function" in done.stderr


@pytest.mark.services
def test_consume_refuses_a_handler_whose_arguments_do_not_fit_the_mode(tmp_path: Path) -> None:
    """A one-argument handler with ``--mode transactional`` used to start, then fail every
    message with ``TypeError: ... takes 1 positional argument but 2 were given`` and
    dead-letter it. Refused at start now, before the broker is read, naming the call."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_arity")
    base = ["consume", "--broker", RABBITMQ_URL, "--source", source, "--consumer", "c",
            "--store", f"sqlite:///{tmp_path / 'inbox.db'}"]  # fmt: skip
    try:
        for handler, mode, takes, called in (
            ("record", "transactional", "(payload)", "handler(tx, payload)"),
            ("record_in", "two-phase", "(tx, payload)", "handler(payload)"),
        ):
            done = subprocess.run(
                [*ONCELY, *base, "--handler", f"tests.brokers.handlers:{handler}", "--mode", mode],
                capture_output=True, text=True, cwd=ROOT, timeout=20, check=False,
            )  # fmt: skip
            assert done.returncode == 2, done.stderr
            assert done.stderr == (
                f"Error: --handler 'tests.brokers.handlers:{handler}' takes {takes}, but the "
                f"{mode} mode calls it as {called}: write it as async def {handler}"
                f"{called.removeprefix('handler')}\n"
            )
        assert not asyncio.run(_queue_exists(source))  # refused before the broker was read
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))


async def _publish(source: str, messages: list[tuple[str | None, dict[str, object]]]) -> None:
    producer = open_producer(RABBITMQ_URL, source)
    try:
        for message_id, body in messages:
            await producer.publish(json.dumps(body).encode(), message_id=message_id or "")
    finally:
        await producer.close()


@pytest.mark.slow
@pytest.mark.services
def test_consume_runs_a_handler_once_per_message_and_stops_on_sigterm(tmp_path: Path) -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_consume")
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}
    command = [
        *ONCELY,
        "consume",
        "--broker",
        RABBITMQ_URL,
        "--source",
        source,
        "--handler",
        "tests.brokers.handlers:record",
        "--store",
        f"sqlite:///{tmp_path / 'inbox.db'}",
        "--consumer",
        "cli-test",
        "--concurrency",
        "4",
        "--log-format",
        "json",
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_queue(source)  # the consumer declares it
        messages: list[tuple[str | None, dict[str, object]]] = [
            ("o-1", {"order": 1}),
            ("o-1", {"order": 1}),  # a producer retry
            ("o-2", {"order": 2}),
            ("o-2", {"order": 2, "changed": True}),  # the id reused: key_conflict
            ("o-3", {"order": 3, "poison": True}),
        ]
        asyncio.run(_publish(source, messages))
        deadline = time.monotonic() + 30
        while len(effects.read_text().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # let the other copies settle (an in_flight one comes back after 1 s)
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    per_message = [line for line in lines if "broker_action" in line]
    # With four messages at a time a copy can arrive while its twin still runs: it is then
    # in_flight and given back, and its redelivery ends as one of the outcomes below.
    requeued = [line for line in per_message if line["outcome"] == "in_flight"]
    assert all(line["broker_action"] == "requeue" for line in requeued), requeued
    per_message = [line for line in per_message if line["outcome"] != "in_flight"]
    outcomes = sorted(line["outcome"] for line in per_message)
    assert outcomes == ["duplicate", "key_conflict", "processed", "processed", "rejected"]
    actions = {line["outcome"]: line["broker_action"] for line in per_message}
    assert actions == {
        "processed": "ack",
        "duplicate": "ack",
        "key_conflict": "dead_letter",
        "rejected": "dead_letter",
    }
    # Each order's effect once. The two copies of o-2 differ and run concurrently, so either
    # may win the claim; the other is the key_conflict.
    applied = sorted(json.loads(line)["order"] for line in effects.read_text().splitlines())
    assert applied == [1, 2]
    assert any("oncely consume stopped" in line["message"] for line in lines)
    horizon = [line for line in lines if "horizon_ms" in line]
    assert len(horizon) == 1, lines
    # R13: 5 deliveries x (RabbitMQ's 30 min consumer timeout + up to 8 s of backoff) + 1 day
    assert horizon[0]["horizon_ms"] == (5 * (1800 + 8) + 86_400) * 1000
    assert "redelivery horizon 1d2h30m40s" in horizon[0]["message"]
    assert "retention 7d covers it" in horizon[0]["message"]


@pytest.mark.services
def test_consume_closes_its_store_on_the_way_out(tmp_path: Path) -> None:
    """Before, the store ``oncely consume`` opened was left to the garbage collector: with
    MariaDB every stop printed a traceback per pooled connection ("Event loop is closed")."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("MariaDB", MYSQL_URL, 3306)
    source = unique("cli_close")
    table = unique("cli_close_inbox")
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    command = [
        *ONCELY, "consume", "--broker", RABBITMQ_URL, "--source", source,
        "--handler", "tests.brokers.handlers:record", "--store", f"{MYSQL_URL}?table={table}",
        "--consumer", "cli-close",
    ]  # fmt: skip
    subprocess.run([*ONCELY, "migrate", "--store", f"{MYSQL_URL}?table={table}"], check=True,
                   cwd=ROOT, capture_output=True)  # fmt: skip
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}

    def one_message() -> None:
        wait_for_queue(source)  # the consumer declares it
        asyncio.run(_publish(source, [("c-1", {"order": 1})]))
        deadline = time.monotonic() + 30
        while not effects.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)

    try:
        code, err = _consume_until_sigterm(command, one_message, env)
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
        drop_tables(table)
    assert code == 0, err
    assert effects.read_text().count("\n") == 1
    assert "Exception ignored" not in err and "Event loop is closed" not in err, err


@pytest.mark.slow
@pytest.mark.services
def test_r10_consume_asks_its_reconciler_about_a_claim_whose_worker_died(tmp_path: Path) -> None:
    """Before, ``oncely consume`` had no --reconciler or --on-stale: a message whose earlier
    worker died mid-handler always ran again, even when ``oncely reconcile`` had left its
    record for a person. Now the consumer's reconciler decides, as on the library."""
    from contextlib import closing

    import oncely
    from tests.cli.helpers import PAST, TOKEN

    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_stale")
    db = tmp_path / "inbox.db"
    with closing(oncely.SQLiteStore(db, clock=oncely.FakeClock(PAST))) as past:
        for key in ("sent-1", "lost-1"):  # claimed in 2020, a one-second lease: stale
            past.claim(
                "cli-stale", key, fingerprint=None, token=TOKEN,
                lease_ms=1000, keep_ms=100 * 365 * 86_400_000, takeover=False,
            )  # fmt: skip
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    command = [
        *ONCELY, "consume", "--broker", RABBITMQ_URL, "--source", source,
        "--handler", "tests.brokers.handlers:record", "--store", f"sqlite:///{db}",
        "--consumer", "cli-stale", "--reconciler", "tests.brokers.handlers:reconcile_by_key",
        "--log-format", "json",
    ]  # fmt: skip
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}

    def stale_messages() -> None:
        wait_for_queue(source)  # the consumer declares it
        asyncio.run(_publish(source, [("sent-1", {"order": 1}), ("lost-1", {"order": 2})]))
        deadline = time.monotonic() + 30
        while effects.read_text().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the outcomes are logged after the reconciler answers

    try:
        code, err = _consume_until_sigterm(command, stale_messages, env)
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
    assert code == 0, err
    # The reconciler was asked about both, and the handler ran for neither.
    asked = sorted(json.loads(line)["asked"] for line in effects.read_text().splitlines())
    assert asked == ["lost-1", "sent-1"]
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    outcomes = {line["key"]: (line["outcome"], line["broker_action"])
                for line in lines if "broker_action" in line}  # fmt: skip
    assert outcomes == {"sent-1": ("duplicate", "ack"), "lost-1": ("escalated", "dead_letter")}
    with closing(oncely.SQLiteStore(db)) as store:
        sent, lost = store.get("cli-stale", "sent-1"), store.get("cli-stale", "lost-1")
    assert sent is not None and sent.status is oncely.Status.COMPLETED
    assert sent.result == b'{"found":"sent-1"}'
    assert lost is not None and lost.status is oncely.Status.IN_PROGRESS and lost.token == TOKEN


def test_consume_takes_one_stale_policy_and_only_in_the_two_phase_mode() -> None:
    base = ["consume", "--broker", "amqp://localhost/", "--source", "q", "--consumer", "c",
            "--handler", "tests.brokers.handlers:record", "--store", "memory://"]  # fmt: skip
    both = _run([*base, "--on-stale", "escalate",
                 "--reconciler", "tests.brokers.handlers:reconcile_by_key"])  # fmt: skip
    assert both.returncode == 2 and "not both" in both.stderr
    in_tx = [*base[:-3], "tests.brokers.handlers:record_in", *base[-2:]]  # (tx, payload)
    transactional = _run([*in_tx, "--mode", "transactional", "--on-stale", "escalate"])
    assert transactional.returncode == 2, transactional.stderr
    assert "--on-stale is for the two-phase mode" in transactional.stderr
    missing = _run([*base, "--reconciler", "tests.brokers.handlers:nowhere"])
    assert missing.returncode == 2 and "has no 'nowhere'" in missing.stderr


@pytest.mark.services
def test_r13_consume_refuses_a_retention_below_its_horizon(tmp_path: Path) -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_horizon")
    done = _run(
        [
            "consume",
            "--broker",
            RABBITMQ_URL,
            "--source",
            source,
            "--handler",
            "tests.brokers.handlers:record",
            "--store",
            f"sqlite:///{tmp_path / 'inbox.db'}",
            "--consumer",
            "cli-test",
            "--max-deliveries",
            "1000",
            "--retention",
            "2h",
            "--resubmit-window",
            "0s",
        ]
    )
    assert done.returncode == 1, done.stderr
    # 1000 deliveries would pass RabbitMQ's delivery limit of 20: 20 x (30 min + 1 min).
    assert (
        "retention 2h is below the redelivery horizon of this consumer on rabbitmq 10h20m "
        "(max_deliveries=20 x (lock=30m + delay=1m) + message_ttl=0s)"
    ) in done.stderr
    asyncio.run(remove_destinations(RABBITMQ_URL, source))


@pytest.mark.services
def test_r13_consume_starts_with_the_retention_oncely_retention_recommends(
    tmp_path: Path,
) -> None:
    """The same numbers give both commands the same horizon. Before, `oncely retention`
    counted neither the consumer's retry delays nor its default resubmit window: it
    recommended 4d for these, and `oncely consume` refused 4d (its horizon 4d1h), advising
    ConsumerSettings.resubmit_window and Retention(keep=...), which a command line has not."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    numbers = ["--max-deliveries", "10", "--message-ttl", "3d"]
    advised = _run(["retention", *numbers, "--lock", "5m", "--json"])
    assert advised.returncode == 0, advised.stderr
    figures = json.loads(advised.stdout)
    source = unique("cli_advised")
    base = ["consume", "--broker", RABBITMQ_URL, "--source", source, "--consumer", "cli-test",
            "--handler", "tests.brokers.handlers:record", "--store",
            f"sqlite:///{tmp_path / 'inbox.db'}", *numbers, "--ack-wait", "5m"]  # fmt: skip
    try:
        short = _run([*base, "--retention", "4d"])
        assert short.returncode == 1, short.stderr
        said = (
            f"below the redelivery horizon of this consumer on rabbitmq {figures['horizon']} "
            f"({figures['formula']})"
        )
        assert said in short.stderr, (short.stderr, figures)
        assert short.stderr.rstrip().endswith(
            f"raise --retention to {figures['recommended']} (the horizon and a quarter, as "
            "`oncely retention` recommends), or lower --max-deliveries, --ack-wait, "
            "--message-ttl or --resubmit-window"
        ), short.stderr
        assert "ConsumerSettings" not in short.stderr and "Retention(" not in short.stderr

        command = [*ONCELY, *base, "--retention", figures["recommended"]]
        process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            assert process.stderr is not None
            line = process.stderr.readline()
            while line and "redelivery horizon" not in line:
                line = process.stderr.readline()
            assert f"redelivery horizon {figures['horizon']} = {figures['formula']}" in line
            assert f"retention {figures['recommended']} covers it" in line, line
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 0
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))


async def _queue_exists(name: str) -> bool:
    import aio_pika
    import aiormq

    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True


def _consume_once(
    source: str, *, broker: str = RABBITMQ_URL, store: str
) -> subprocess.CompletedProcess[str]:
    return _run(
        [
            "consume",
            "--broker",
            broker,
            "--source",
            source,
            "--handler",
            "tests.brokers.handlers:record",
            "--store",
            store,
            "--consumer",
            "cli-test",
        ]
    )


@pytest.mark.services
def test_consume_exits_3_at_start_when_the_store_is_down_and_reads_nothing() -> None:
    # Before, it started, logged itself healthy, and gave every message back to the broker
    # (each one a delivery closer to the dead-letter queue) until someone read the logs.
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_store_down")
    port = free_port()
    done = _consume_once(source, store=f"postgresql://postgres:s3cret@127.0.0.1:{port}/test")
    assert done.returncode == 3, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "s3cret" not in done.stderr
    assert "Traceback" not in done.stderr and "oncely consume stopped" not in done.stderr
    # The store is checked before the broker is opened: the queue was never even declared.
    assert not asyncio.run(_queue_exists(source))


@pytest.mark.services
def test_consume_says_a_sqlite_directory_is_missing(tmp_path: Path) -> None:
    # Before, "unable to open database file", as for a store to try again later.
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_no_dir")
    path = tmp_path / "missing" / "inbox.db"
    done = _consume_once(source, store=f"sqlite:///{path}")
    assert done.returncode == 3, done.stderr
    assert done.stderr == (
        f"Error: cannot open the SQLite database {path}: there is no directory {path.parent} "
        "(oncely creates the database file, not its directory)\n"
    )
    assert not asyncio.run(_queue_exists(source))


@pytest.mark.services
@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"password": "not-the-password"}, "ACCESS_REFUSED"),
        ({"vhost": "no_such_vhost_oncely"}, "virtual host"),
    ],
    ids=["wrong-password", "unknown-vhost"],
)
def test_consume_exits_6_when_rabbitmq_refuses_it_at_start(
    tmp_path: Path, change: dict[str, str], said: str
) -> None:
    # A refusal is not an outage: retrying the same credentials forever helps no one.
    require("RabbitMQ", RABBITMQ_URL, 5672)
    parts = urlsplit(RABBITMQ_URL)
    user = parts.username or "guest"
    password = change.get("password", parts.password or "guest")
    vhost = change.get("vhost", parts.path.lstrip("/"))
    broker = f"amqp://{user}:{password}@{parts.hostname}:{parts.port or 5672}/{vhost}"
    done = _consume_once(
        unique("cli_refused"), broker=broker, store=f"sqlite:///{tmp_path / 'inbox.db'}"
    )
    assert done.returncode == 6, done.stderr
    assert "RabbitMQ refused" in done.stderr and said in done.stderr, done.stderr
    assert "not-the-password" not in done.stderr
    assert "error when creating transport" not in done.stderr


@pytest.mark.services
def test_consume_exits_6_when_redis_refuses_its_credentials(tmp_path: Path) -> None:
    """Before, Redis's WRONGPASS (a ConnectionError to redis-py) was retried forever with
    backoff, as if the server were away."""
    require("Redis", REDIS_URL, 6379)
    parts = urlsplit(REDIS_URL)
    broker = f"redis://nobody:not-the-password@{parts.hostname}:{parts.port or 6379}{parts.path}"
    done = _consume_once(
        unique("cli_refused"), broker=broker, store=f"sqlite:///{tmp_path / 'inbox.db'}"
    )
    assert done.returncode == 6, done.stderr
    assert "Redis refused the credentials" in done.stderr, done.stderr
    assert "not-the-password" not in done.stderr


@pytest.mark.services
@pytest.mark.slow
def test_consume_stopped_before_the_broker_answers_says_why_and_claims_no_horizon() -> None:
    """Before, the failure read "TimeoutError: " (nats-py's error has no text), and a stop
    before any connection still logged a redelivery horizon "from JetStream consumer ..."
    that no broker had said."""
    command = [*ONCELY, "consume", "--broker", f"nats://127.0.0.1:{free_port()}",
               "--source", "s", "--consumer", "c", "--handler", "tests.brokers.handlers:record",
               "--store", "memory://"]  # fmt: skip
    code, err = _consume_until_sigterm(command, lambda: time.sleep(7))
    assert code == 0, err
    assert "no connection within 5s" in err and "TimeoutError" not in err, err
    assert "redelivery horizon" not in err and "oncely consume stopped: idle" in err, err


def test_consume_on_a_memory_store_warns_that_a_restart_forgets_it() -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_memory")
    command = [
        *ONCELY, "consume", "--broker", RABBITMQ_URL, "--source", source,
        "--handler", "tests.brokers.handlers:record", "--store", "memory://",
        "--consumer", "cli-memory",
    ]  # fmt: skip
    try:
        code, err = _consume_until_sigterm(command, lambda: time.sleep(3))
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
    assert code == 0, err
    assert "the store is memory://, which lives in this process only" in err, err
    # Every store that keeps records across restarts is named, DynamoDB too (it was left out).
    assert "use SQLite, PostgreSQL, MariaDB/MySQL, Redis or DynamoDB for" in err, err


@pytest.mark.slow
def test_client_library_lines_keep_the_log_format_and_do_not_flood(tmp_path: Path) -> None:
    # Kafka at a port where nothing listens: aiokafka logs its own error on every attempt.
    # Before, those lines went to stderr as plain text (breaking a JSON log) and repeated.
    command = [
        *ONCELY,
        "consume",
        "--broker",
        f"kafka://127.0.0.1:{free_port()}",
        "--source",
        "orders",
        "--handler",
        "tests.brokers.handlers:record",
        "--store",
        "memory://",
        "--consumer",
        "cli-test",
        "--log-format",
        "json",
    ]
    # five attempts or so, each one logged by aiokafka
    code, err = _consume_until_sigterm(command, lambda: time.sleep(6))
    assert code == 0, err
    lines = [json.loads(line) for line in err.splitlines()]  # every line is JSON
    theirs = [line for line in lines if not line["logger"].startswith("oncely")]
    ours = [line for line in lines if "unavailable" in line["message"]]
    assert len(ours) >= 3, lines  # the consumer tried again and said so each time
    assert theirs and all(line["logger"].startswith("aiokafka") for line in theirs), theirs
    assert len(theirs) < len(ours), lines  # one of a kind per 30 s, not one per attempt
    assert all(line["time"].endswith("Z") for line in lines)  # UTC, whatever the TZ


def test_repeated_records_are_let_through_once_per_window() -> None:
    import logging

    from oncely._repeats import Repeats

    repeats = Repeats(window=30)

    def record(at: float, msg: str = "Unable connect to %r") -> logging.LogRecord:
        made = logging.LogRecord("aiokafka", logging.ERROR, __file__, 1, msg, ("x",), None)
        made.created = at
        return made

    passed = [r for r in (record(t) for t in (0, 1, 2, 29.9)) if repeats.filter(r)]
    assert len(passed) == 1
    assert repeats.filter(record(5, "another kind %r"))  # another message: its own window
    later = record(31)
    assert repeats.filter(later) and "(3 more like it in the last 30s)" in later.getMessage()


@pytest.mark.slow
@pytest.mark.services
def test_r16_consume_with_tracing_continues_the_producers_trace(tmp_path: Path) -> None:
    """``oncely consume --tracing`` makes a span per message through the global tracer
    provider (here set by the handler's module, as an application sets up OpenTelemetry),
    child of the context the producer put in the headers, with the handler's span inside."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    from oncely.tracing import inject

    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_traced")
    spans = tmp_path / "spans.jsonl"
    spans.touch()
    env = {**os.environ, "ONCELY_TEST_SPANS": str(spans)}
    command = [
        *ONCELY,
        "consume",
        "--broker",
        RABBITMQ_URL,
        "--source",
        source,
        "--handler",
        "tests.brokers.traced_handlers:charge",
        "--store",
        f"sqlite:///{tmp_path / 'inbox.db'}",
        "--consumer",
        "cli-traced",
        "--tracing",
    ]
    provider = TracerProvider()

    async def publish() -> tuple[int, int]:
        producer = open_producer(RABBITMQ_URL, source)
        try:
            with provider.get_tracer("the-shop").start_as_current_span("checkout") as span:
                await producer.publish(b'{"order": 1}', message_id="o-1", headers=inject())
                return span.get_span_context().trace_id, span.get_span_context().span_id
        finally:
            await producer.close()

    def meanwhile() -> None:
        wait_for_queue(source)  # the consumer declares it
        trace_id, span_id = asyncio.run(publish())
        deadline = time.monotonic() + 30
        while len(spans.read_text().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = [json.loads(line) for line in spans.read_text().splitlines()]
        (consumed,) = [s for s in found if s["name"] == f"process {source}"]
        (charged,) = [s for s in found if s["name"] == "charge"]
        assert consumed["kind"] == "CONSUMER"
        assert (consumed["trace_id"], consumed["parent_id"]) == (trace_id, span_id)
        assert consumed["attributes"]["oncely.outcome"] == "processed"
        assert consumed["attributes"]["oncely.broker_action"] == "ack"
        assert consumed["attributes"]["messaging.system"] == "rabbitmq"
        assert charged["parent_id"] == consumed["span_id"]

    try:
        code, err = _consume_until_sigterm(command, meanwhile, env)
        assert code == 0, err
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
