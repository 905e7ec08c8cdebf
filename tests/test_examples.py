"""The README's tour, run as a user would run it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.brokers.common import remove_destinations
from tests.services import NATS_URL, POSTGRES_DSN, RABBITMQ_URL, REDIS_URL, require

ROOT = Path(__file__).resolve().parent.parent


def test_r1_quickstart_applies_each_effect_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "transactional, delivery 1: processed {'booked': 42}",
        "transactional, delivery 2: duplicate {'booked': 42}",
        "two-phase, delivery 1: processed 'receipt for pay-1'",
        "two-phase, delivery 2: duplicate 'receipt for pay-1'",
        "reused key, changed amount: key_conflict -> dead_letter",
        "ledger rows: 1, receipts sent: 1",
    ]


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.parametrize(
    ("broker", "url", "port"),
    [
        ("RabbitMQ", RABBITMQ_URL, 5672),
        ("Redis", REDIS_URL, 6379),
        ("NATS", NATS_URL, 4222),
    ],
)
def test_orders_example(broker: str, url: str, port: int) -> None:
    # R20-R22 end to end: one command from examples/orders/README.md, on a real broker.
    require(broker, url, port)
    require("PostgreSQL", POSTGRES_DSN, 5432)
    database = POSTGRES_DSN.replace("postgresql://", "postgresql+psycopg://", 1)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "orders" / "run.py"),
            "--broker",
            url,
            "--database",
            database,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    found = re.search(r"source: (\S+)", done.stdout)
    if found:  # the example made a queue (stream, subject) of its own: remove it
        asyncio.run(remove_destinations(url, found.group(1)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every order created exactly once: yes" in done.stdout
    # Every broker dead-letters the reused id (R20 step 6). On NATS the stream's duplicate
    # window drops the ten retries (R14), but not the reuse: oncely's producer hashes the body
    # into Nats-Msg-Id.
    assert "  key_conflict  1" in done.stdout
    if broker == "NATS":
        assert "dropped by the stream's duplicate window: 10" in done.stdout
        assert "  duplicate     0" in done.stdout
    else:
        assert "  duplicate     10" in done.stdout


@pytest.mark.slow
@pytest.mark.services
def test_r7_the_broker_consumer_example_books_each_payment_once() -> None:
    """The README's broker example, end to end on RabbitMQ and PostgreSQL."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("PostgreSQL", POSTGRES_DSN, 5432)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "broker_consumer.py"), RABBITMQ_URL, POSTGRES_DSN],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outcomes: {'duplicate': 1, 'processed': 3}" in done.stdout, done.stdout
    assert "ledger: [('pay-1', 10), ('pay-2', 20), ('pay-3', 30)]" in done.stdout


@pytest.mark.services
def test_r1_r16_the_dramatiq_example_charges_once_and_dead_letters_the_keyless(
    tmp_path: Path,
) -> None:
    pytest.importorskip("dramatiq")
    require("RabbitMQ", RABBITMQ_URL, 5672)
    done = _on_rabbitmq("dramatiq_actors.py", tmp_path)
    assert done.stdout.splitlines() == [
        "receipt for o-1",
        "charges: [('o-1', 42)]",
        "dead-lettered: no idempotency key: the producer gave none",
    ]


@pytest.mark.services
@pytest.mark.parametrize(
    ("library", "example", "results"),
    [
        ("celery", "celery_tasks.py", "results: 3, all {'order': 'o-1', 'charged': 42}: True"),
        ("taskiq_aio_pika", "taskiq_tasks.py", "results: [42, 42, 42]"),
    ],
)
def test_r1_r16_the_task_queue_examples_charge_once_and_dead_letter_the_keyless(
    library: str, example: str, results: str, tmp_path: Path
) -> None:
    """The Celery and taskiq examples: three sends of one charge give one row and the first
    result three times, a resend under one key one receipt, a keyless send a dead letter."""
    pytest.importorskip(library)
    require("RabbitMQ", RABBITMQ_URL, 5672)
    done = _on_rabbitmq(example, tmp_path)
    lines = done.stdout.splitlines()
    assert lines[:2] == [results, "receipt for o-1"], done.stdout
    assert lines[2].startswith(
        "dead-lettered: rejected: no idempotency key: the producer gave none; the message is in"
    ), done.stdout
    assert lines[3:] == ["charges: [('o-1', 42)]"], done.stdout


@pytest.mark.services
def test_r1_the_taskiq_example_sends_its_tasks_only_once_its_queue_is_bound(
    tmp_path: Path,
) -> None:
    """Before, the example sent its tasks as soon as the broker had a channel to write on,
    which taskiq-aio-pika opens before it declares its exchange and queue: a task sent in
    that moment was routed nowhere and lost, and the example waited 30 s for its result and
    failed (in more than half of the runs on a busy machine). Now the broker's start-up is
    awaited before the first send. Run a few times: the race was in its first moment."""
    pytest.importorskip("taskiq_aio_pika")
    require("RabbitMQ", RABBITMQ_URL, 5672)
    for run in range(4):
        done = _on_rabbitmq("taskiq_tasks.py", tmp_path / str(run))
        assert done.stdout.startswith("results: [42, 42, 42]\n"), (run, done.stdout)


@pytest.mark.services
def test_r1_r2_the_faststream_example_charges_once_and_dead_letters_the_made_up_id(
    tmp_path: Path,
) -> None:
    pytest.importorskip("faststream")
    require("RabbitMQ", RABBITMQ_URL, 5672)
    done = _on_rabbitmq("faststream_orders.py", tmp_path)
    lines = done.stdout.splitlines()
    assert "charges: [('o-1', 42)]" in lines, done.stdout
    assert (
        "dead-lettered: the id has the shape aio-pika's client gives a message published "
        "without one" in lines
    ), done.stdout


def _on_rabbitmq(example: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run a worker example on the machine's RabbitMQ with its files in ``directory``."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), RABBITMQ_URL, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.services
def test_r7_the_django_example_charges_once_and_refunds_once(tmp_path: Path) -> None:
    """The Django project of ``examples/django_shop``: its worker (``manage.py oncely consume``
    running ``orders/handlers.py``'s ``charge``) charges an order sent three times once and
    dead-letters its id reused for another amount; ``refund``, called twice, goes through
    ``handle_in_atomic`` and writes one row."""
    pytest.importorskip("django")
    require("RabbitMQ", RABBITMQ_URL, 5672)
    done = _on_rabbitmq("django_shop/run.py", tmp_path)
    assert done.stdout.splitlines() == [
        "refund: processed, row 2",
        "refund again: duplicate, row 2",
        "dead-lettered: key reused for different content",
        "charges: [('o-1', -42), ('o-1', 42)]",
        "worker exit code: 0",
    ], done.stdout


@pytest.mark.services
def test_r7_the_dynamodb_example_books_the_payment_once() -> None:
    """The transactional mode on DynamoDB (moto's server): the ledger item, the balance and
    the marker in one TransactWriteItems, the second delivery a duplicate."""
    from tests.backends.dynamodb import drop_table, endpoint

    table = f"oncely_example_{uuid.uuid4().hex[:12]}"
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "dynamodb_ledger.py"),
             f"http://{endpoint()}", table],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "AWS_ACCESS_KEY_ID": "example", "AWS_SECRET_ACCESS_KEY": "example",
                 "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"},
        )  # fmt: skip
    finally:
        for name in (f"{table}_ledger", f"{table}_accounts", table):
            drop_table(name)  # the example deletes them; a failed run may not have
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "delivery 1: processed {'booked': 42}",
        "delivery 2: duplicate {'booked': 42}",
        "balance: 42",
    ]
