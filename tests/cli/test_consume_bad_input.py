"""``oncely consume`` given what foreign producers send: its log lines cannot be forged, what a
person must act on shows at ``--log-level warning``, the key and body limits are flags, and a
CloudEvent's data can be the payload. A real consumer process on the real RabbitMQ; the
messages are published with pika, which can send what oncely's producer never would."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from oncely._core.observe import key_for_logs
from tests.brokers.common import remove_destinations, unique
from tests.brokers.foreign import publish_amqp, wait_for_queue
from tests.services import RABBITMQ_URL, require

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ ")  # UTC, ISO 8601


def _consume(
    tmp_path: Path,
    messages: Sequence[tuple[bytes, Mapping[str, Any]]],
    *options: str,
    handler: str = "record",
    settled: int,
    broker: str = RABBITMQ_URL,
) -> tuple[str, list[dict[str, Any]]]:
    """Run ``oncely consume`` on a fresh queue until ``settled`` messages have a per-message
    log line, then SIGTERM it; its stderr and the effects its handler recorded."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("cli_bad")
    effects = tmp_path / "effects.jsonl"
    effects.touch()
    command = [
        sys.executable,
        "-m",
        "oncely.cli",
        "consume",
        "--broker",
        broker,
        "--source",
        source,
        "--handler",
        f"tests.brokers.handlers:{handler}",
        "--store",
        f"sqlite:///{tmp_path / 'inbox.db'}",
        "--consumer",
        "cli-bad",
        *options,
    ]
    env = {**os.environ, "ONCELY_TEST_EFFECTS": str(effects)}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_queue(source)  # the consumer declares it
        asyncio.run(publish_amqp(source, messages))
        deadline = time.monotonic() + 30
        while len(effects.read_text().splitlines()) < settled and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)  # the refused ones settle too (they never reach the handler)
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
    assert process.returncode == 0, err
    done = [json.loads(line) for line in effects.read_text().splitlines()]
    return err, done


def _json_lines(err: str) -> list[dict[str, Any]]:
    lines = []
    for line in err.splitlines():
        assert line.startswith("{"), f"a line that is not JSON: {line!r}"
        lines.append(json.loads(line))
    return lines


def test_r16_a_key_holding_a_newline_cannot_forge_a_text_log_line(tmp_path: Path) -> None:
    forged = "k-1\n2026-12-01 00:00:00,000 INFO oncely broker=rabbitmq outcome=processed key=x"
    err, done = _consume(
        tmp_path,
        [(b'{"order": 1}', {"message_id": forged.encode(), "correlation_id": "c\r\n1"})],
        "--log-format",
        "text",
        settled=1,
    )
    assert done == [{"order": 1}]
    for line in err.splitlines():
        assert _STAMP.match(line), f"a line that no record wrote: {line!r}"
    processed = [line for line in err.splitlines() if "outcome=processed" in line]
    assert len(processed) == 1, processed
    assert "key=k-1\\n2026-12-01" in processed[0]


def test_r16_a_result_not_stored_shows_at_log_level_warning(tmp_path: Path) -> None:
    err, done = _consume(
        tmp_path,
        [(b'{"order": 2}', {"message_id": "u-1"})],
        "--log-format",
        "json",
        "--log-level",
        "warning",
        handler="unstorable",
        settled=1,
    )
    assert done == [{"order": 2}]
    lines = _json_lines(err)
    outcome = [line for line in lines if line.get("broker_action")]
    assert [(line["outcome"], line["level"]) for line in outcome] == [("processed", "warning")]
    assert "result not stored" in outcome[0]["reason"]
    assert any(
        line["level"] == "error" and "result not stored" in line["message"] for line in lines
    )


def test_r16_log_keys_hash_keeps_keys_out_of_every_line(tmp_path: Path) -> None:
    """Keys that are personal data: ``--log-keys hash`` logs a digest of each key on every
    line (the outcome lines, a key conflict's too), with the message's correlation id."""
    err, done = _consume(
        tmp_path,
        [
            (b'{"order": 3}', {"message_id": "alice@example.com", "correlation_id": "corr-a"}),
            (b'{"order": 4}', {"message_id": "alice@example.com", "correlation_id": "corr-b"}),
        ],
        "--log-format",
        "json",
        "--log-keys",
        "hash",
        settled=1,
    )
    assert done == [{"order": 3}]
    assert "alice@example.com" not in err
    outcome = [line for line in _json_lines(err) if line.get("broker_action")]
    assert sorted((line["outcome"], line["correlation_id"]) for line in outcome) == [
        ("key_conflict", "corr-b"),
        ("processed", "corr-a"),
    ]
    assert {line["key"] for line in outcome} == {key_for_logs("alice@example.com", "hash")}


def test_r16_hooks_receive_every_outcome_and_a_failing_one_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--hook`` (repeatable) hands every outcome to a function of the user's, for metrics
    (R16: a count of duplicates): a hook that raises is logged, and neither stops the
    consumer nor changes any message's outcome or the hooks after it."""
    hooks = tmp_path / "hooks.jsonl"
    hooks.touch()
    monkeypatch.setenv("ONCELY_TEST_HOOKS", str(hooks))
    err, done = _consume(
        tmp_path,
        [
            (b'{"order": 5}', {"message_id": "h-1", "correlation_id": "c-1"}),
            (b'{"order": 5}', {"message_id": "h-1", "correlation_id": "c-2"}),
            (b'{"order": 6}', {"message_id": "h-1", "correlation_id": "c-3"}),
            (b'{"order": 7}', {"message_id": "h-2", "correlation_id": "c-4"}),
        ],
        "--log-format",
        "json",
        "--hook",
        "tests.brokers.handlers:broken_hook",
        "--hook",
        "tests.brokers.handlers:note_outcome",
        settled=2,
    )
    assert sorted(json.dumps(d) for d in done) == ['{"order": 5}', '{"order": 7}']
    seen = sorted(tuple(json.loads(line)) for line in hooks.read_text().splitlines())
    assert seen == [
        ("duplicate", "h-1", "c-2"),
        ("key_conflict", "h-1", "c-3"),
        ("processed", "h-1", "c-1"),
        ("processed", "h-2", "c-4"),
    ]
    lines = _json_lines(err)
    failures = [line for line in lines if "metrics exporter down" in line.get("error", "")]
    assert len(failures) == 4 and all(line["level"] == "error" for line in failures)
    outcome = [line for line in lines if line.get("broker_action")]
    assert sorted(line["outcome"] for line in outcome) == [
        "duplicate",
        "key_conflict",
        "processed",
        "processed",
    ]


def test_an_async_hook_is_refused_at_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oncely.cli",
            "consume",
            "--broker",
            RABBITMQ_URL,
            "--source",
            unique("cli_hook"),
            "--handler",
            "tests.brokers.handlers:record",
            "--store",
            f"sqlite:///{tmp_path / 'inbox.db'}",
            "--consumer",
            "cli-hook",
            "--hook",
            "tests.brokers.handlers:record",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--hook" in done.stderr and "plain def" in done.stderr


def test_the_key_and_body_limits_are_flags(tmp_path: Path) -> None:
    long_key = "k" * 40
    messages = [
        (b'{"order": 3, "pad": "' + b"x" * 80 + b'"}', {"message_id": "big-1"}),
        (b'{"order": 4}', {"message_id": long_key}),
        (b'{"order": 5}', {"message_id": "fits-1"}),
    ]
    err, done = _consume(
        tmp_path,
        messages,
        "--log-format",
        "json",
        "--max-body-bytes",
        "64",
        "--max-key-bytes",
        "32",
        settled=1,
    )
    assert done == [{"order": 5}]
    outcome = {line["key"]: line for line in _json_lines(err) if line.get("broker_action")}
    assert outcome["big-1"]["outcome"] == "rejected"
    assert "over the limit of 64" in outcome["big-1"]["reason"]
    (too_long,) = [
        line for line in outcome.values() if "bytes, over the limit of 32" in (line["reason"] or "")
    ]
    assert too_long["broker_action"] == "dead_letter"
    assert "--hash-long-keys" in too_long["reason"]

    again = tmp_path / "hashed"
    again.mkdir()
    err, done = _consume(
        again,
        [(b'{"order": 4}', {"message_id": long_key})],
        "--log-format",
        "json",
        "--max-key-bytes",
        "32",
        "--hash-long-keys",
        settled=1,
    )
    assert done == [{"order": 4}]
    (line,) = [line for line in _json_lines(err) if line.get("broker_action")]
    assert line["outcome"] == "processed" and line["key"].startswith("sha256:")


def test_r2_r4_an_id_of_the_shape_aio_pika_makes_up_is_refused_unless_trusted(
    tmp_path: Path,
) -> None:
    """aio-pika's client gives a message published without an id ``uuid4().hex``, a new one
    on every publish: a producer's retry was processed twice. Such an id (sent here as it
    arrives) is dead-lettered with the fixes named; the URL option
    ``trust_hex_message_ids=true`` takes it as the producer's, so a retry is a duplicate."""
    made_up = uuid.uuid4().hex
    messages = [
        (b'{"order": 8}', {"message_id": made_up}),
        (b'{"order": 8}', {"message_id": made_up}),
        (b'{"order": 9}', {"message_id": "m-9"}),
    ]
    # One at a time, in order: the refused copies are settled before order 9's effect shows,
    # and the trusted retry meets a completed record (a duplicate), never its first copy
    # still running (in_flight, given back after the lease: longer than the test waits).
    one = ("--log-format", "json", "--concurrency", "1")
    err, done = _consume(tmp_path, messages, *one, settled=1)
    assert done == [{"order": 9}]
    lines = [line for line in _json_lines(err) if line.get("broker_action")]
    refused = [line for line in lines if line["outcome"] == "rejected"]
    assert len(refused) == 2, lines
    for line in refused:
        assert line["broker_action"] == "dead_letter"
        assert made_up in line["reason"] and "trust_hex_message_ids=true" in line["reason"]

    again = tmp_path / "trusted"
    again.mkdir()
    err, done = _consume(
        again,
        messages[:2],
        *one,
        settled=1,
        broker=RABBITMQ_URL + "?trust_hex_message_ids=true",
    )
    assert done == [{"order": 8}]
    outcomes = sorted(line["outcome"] for line in _json_lines(err) if line.get("broker_action"))
    assert outcomes == ["duplicate", "processed"]


def test_r3_the_handler_can_get_a_cloudevents_data(tmp_path: Path) -> None:
    event = {
        "specversion": "1.0",
        "id": "e-1",
        "source": "/orders",
        "type": "order.created",
        "data": {"order": 6},
    }
    binary = {
        "message_id": "m-7",
        "headers": {"cloudEvents_source": "/orders", "cloudEvents_id": "e-2"},
    }
    err, done = _consume(
        tmp_path,
        [
            (json.dumps(event).encode(), {"content_type": "application/cloudevents+json"}),
            (b'{"order": 7}', binary),
        ],
        "--log-format",
        "json",
        "--key",
        "cloudevents",
        "--payload",
        "data",
        settled=2,
    )
    assert sorted(d["order"] for d in done) == [6, 7]
    keys = sorted(line["key"] for line in _json_lines(err) if line.get("broker_action"))
    assert keys == ["/orders e-1", "/orders e-2"]


def test_r2_a_correlation_id_key_is_warned_about() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oncely.cli",
            "consume",
            "--broker",
            "amqp://127.0.0.1:1/",
            "--source",
            "q",
            "--consumer",
            "c",
            "--store",
            "memory://",
            "--key",
            "correlation-id",
            "--handler",
            "tests.brokers.handlers:missing",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2  # the handler does not exist; the warning comes before that
    assert "warning: --key correlation-id" in done.stderr and "R2" in done.stderr
