"""The bad-input campaign: a seeded generator of good and bad messages sent by foreign producers
through a real ``oncely consume`` process, and an account of where every one of them ended.

Run it::

    python -m tests.chaos.campaign --broker rabbitmq|redis|nats [--messages 2000] [--seed 7]
        [--hash-long-keys] [--payload body|data] [--deadline S] [--save-log PATH] [--keep]

It prints one row per class (sent, expected, processed, duplicate, dead-lettered, still queued,
effects, lost, dropped by the broker), one dead-letter reason of each class, what broke, and a
``VERDICT`` line, and exits 1 on any violation or missed expectation. ``--messages`` is a
minimum: every class is sent at least 3 times (about 140 copies), then classes drawn by weight.
``tests/chaos/test_campaign.py`` runs a short version on each broker (``ONCELY_CAMPAIGN_MESSAGES``,
150 by default; 2,000 is the full size).

**Producers.** Nothing is sent with oncely's producers, which refuse most of these messages:
RabbitMQ gets pika (it sends ``bytes`` as AMQP short strings, so a message id can be any
octets; a ``str`` subclass makes it send a header long string that is not UTF-8), Redis Streams
a raw ``XADD`` with the adapter's field layout (``body``, ``message_id``, ``content_type``,
``correlation_id``, headers for the rest), and NATS a socket speaking the client protocol
(``CONNECT``, ``HPUB`` with a reply subject for the JetStream ``PubAck``), so header values can
be any octets but CR and LF (the clients are :mod:`tests.brokers.foreign`'s, which the
foreign-producer tests use too; the drivers are :mod:`tests.chaos.campaign_brokers`). The NATS
stream is created here with a 1 s duplicate window: copies the broker drops within it (the
``PubAck`` says ``duplicate``) are *dropped by the broker before oncely*, never lost. Every copy
carries an ``x-campaign: <class>:<n>:<copy>`` header, which dead-letter copies keep, so each is
traced back to the copy that was sent.

**The consumer.** ``oncely consume`` in two-phase mode with a PostgreSQL store (a table of the
run's own), ``--key cloudevents,message-id``, ``--concurrency 16``, ``--max-deliveries 3``,
``--ack-wait 3s``, ``--log-format json`` and, when this ``oncely consume`` has them,
``--max-key-bytes 200`` and ``--max-body-bytes 16384`` (``--hash-long-keys`` on request).
The handler (:mod:`tests.chaos.campaign_handlers`) records every call and every effect in a
PostgreSQL table and behaves as the body's class says. Phase 1 sends every first copy, phase 2
(after the duplicate window) the late retries and reused ids. The run ends when every copy has
an outcome (on RabbitMQ, whose log lines name no copy, also once the log is quiet and the
queue empty), or at the deadline (30 s + 40 ms per copy): a stalled queue is then reported as
copies still queued, never waited for. The consumer gets SIGTERM; the dead-letter destination
and what is left in the queue are read back with the same foreign clients.

**Classes**, each as *what is sent* -> *what must become of each copy* (``dead``: dead-lettered
with ``x-oncely-outcome`` and an ``x-oncely-reason`` matching the class's pattern):

- ``good``: a plain JSON message -> processed
- ``retry_burst``: one id and body 2-3 times back to back, so they race -> 1 processed, the rest
  duplicate
- ``retry_spread``: one id and body 3 times, far apart -> 1 processed, 2 duplicate
- ``retry_late``: one id and body again in phase 2 -> processed + duplicate
- ``id_reuse``: the id again in phase 2 with another body -> processed + dead ``key_conflict``
- ``reject_repeat``: a poison message, again in phase 2 -> 2 x dead ``rejected``, handler once
- ``no_id`` / ``empty_id``: no message id / an empty one -> dead ``rejected``
- ``id_not_utf8``: ``b"inv-\\xff<n>"`` -> dead ``rejected``, the reason names the id
- ``latin1_pair``: ``Müller-<n>`` and ``Möller-<n>`` in Latin-1 (one byte apart) -> both dead
  ``rejected``, never merged into one key
- ``id_unicode``: a valid non-ASCII UTF-8 id -> processed under exactly that key
- ``id_control``: an id with LF, CR, ESC, BEL, DEL and a forged JSON log line in it (no CR/LF on
  NATS; no space, which ``cloudevents,message-id`` refuses in an id) -> processed under that
  key, and no forged line in the log
- ``id_nul``: an id with a NUL -> dead ``rejected``
- ``key_at_max``: a key of exactly the key limit in UTF-8 bytes (two-byte characters) ->
  processed
- ``key_over_max``: one byte more -> dead ``rejected`` (``--hash-long-keys``: processed under
  ``sha256:...``). On RabbitMQ with the default 512-byte limit both travel as CloudEvents
  headers: an AMQP message id holds 255 bytes at most.
- ``body_not_json`` / ``body_empty``: garbage / nothing with a JSON content type -> dead
  ``rejected``
- ``text_not_utf8``: ``text/plain`` with bytes that are not UTF-8 -> dead ``rejected``
- ``text_plain_ok`` / ``binary_ok``: UTF-8 ``text/plain`` / ``application/octet-stream`` ->
  processed (the handler gets text / bytes)
- ``body_at_cap``: a body of exactly ``--max-body-bytes`` (16,384) -> processed
- ``body_over_cap``: one byte more -> dead ``rejected``, the reason says the size
- ``body_far_over_cap``: 4x the cap, not JSON -> dead ``rejected`` for its size (not for not
  being JSON: refused before decoding)
- ``json_nested_ok`` / ``json_too_deep``: JSON nested 100 / 5,000 deep -> processed / dead
  ``rejected``
- ``json_non_finite``: ``1e999`` (decodes to a float infinity) -> processed
- ``raise_once``: the handler raises on its first call -> processed after one retry
- ``raise_always``: the handler always raises -> dead ``rejected``, "failed on all 3
  deliveries", the handler called 3 times
- ``reject``: the handler raises ``oncely.Reject`` -> dead ``rejected``
- ``result_unserialisable`` / ``result_oversized``: the handler returns an object no codec
  stores / 300 KiB -> processed, logged at WARNING or ERROR with "result not stored"
- ``correlation_not_utf8``: a correlation id that is not UTF-8 -> dead ``rejected``, named
- ``header_not_utf8``: unrelated headers that are not UTF-8 -> processed
- ``ce_binary`` / ``ce_binary_alt``: CloudEvents binary mode without a message id, the
  binding's prefixes (AMQP ``cloudEvents_`` / ``cloudEvents:``, Redis ``ce_`` / ``ce-``, NATS
  ``ce-`` / ``ce_``) -> processed under ``"<source> <id>"``
- ``ce_structured``: ``application/cloudevents+json`` -> processed under ``"<source> <id>"``
- ``ce_id_not_utf8`` / ``ce_source_space``: a CloudEvents id that is not UTF-8 / a source with
  spaces -> dead ``rejected``
- ``slow``: the handler sleeps 3.5 s, past the 3 s ack wait -> processed once, no duplicate
- ``amqp_property_not_utf8`` (RabbitMQ): five copies, each with one more basic property that
  is not UTF-8 (``app_id``, ``type``, ``reply_to``, ``content_encoding``, ``content_type``) ->
  each dead ``rejected``, the reason naming its property
- ``redis_no_body_field`` (Redis): an entry with no ``body`` field -> dead ``rejected``, the
  reason says the field is missing

**Invariants** (any breach fails the run): every copy sent is accounted for: ``sent = dropped
by the broker + processed + duplicate + dead-lettered + still queued``, so ``lost`` is 0 for
every class; nothing is still queued at the end (nothing stalled); every dead-letter copy has
``x-oncely-reason`` and ``x-oncely-outcome``; no effect is applied more often than once per
logical message; every stderr line of the consumer is a JSON object and none was forged; the
consumer process is alive until it is sent SIGTERM, and then exits 0. On top of these, every
class must end as its entry above says (outcome counts, reasons, handler calls, effects, the key
it was processed under, and WARNING or ERROR for ``result not stored``, ``key_conflict`` and
dead letters): a difference is reported per class.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg

from tests.chaos.campaign_account import LogBook, Report, account, short
from tests.chaos.campaign_brokers import DRIVERS, Sent, with_query
from tests.chaos.campaign_plan import (
    ACK_WAIT_S,
    BODY_CAP,
    BROKERS,
    CONCURRENCY,
    CONSUMER,
    HANDLER,
    KEY_LIMIT_DEFAULT,
    KEY_LIMIT_FLAG,
    KEY_SPEC,
    MAX_DELIVERIES,
    PHASE_GAP_S,
    SLOW_S,
    Ctx,
    generate,
)
from tests.services import POSTGRES_DSN

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- the consumer


FLAGS = ("--max-key-bytes", "--hash-long-keys", "--max-body-bytes", "--payload")


@functools.cache
def cli_features() -> dict[str, bool]:
    """Which of the flags being added this ``oncely consume`` has."""
    done = subprocess.run(
        [sys.executable, "-m", "oncely.cli", "consume", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    found = set(re.findall(r"--[a-z][a-z-]*", done.stdout))
    return {flag: flag in found for flag in FLAGS}


class ConsumerProcess:
    """``oncely consume`` as a child process, its output read line by line by threads."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.err: list[bytes] = []
        self.out: list[bytes] = []
        self._readers = [
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.err), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stdout, self.out), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: Any, into: list[bytes]) -> None:
        for line in iter(stream.readline, b""):
            into.append(line.rstrip(b"\n"))
        stream.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM, then the exit code (``None``: it had to be killed)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            code = None
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------------- one run


def _fx_tables(run: str) -> tuple[str, str]:
    return f"campaign_fx_{run}", f"campaign_inbox_{run}"


def _sql(statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        cursor = conn.execute(statement)  # type: ignore[call-overload]
        return cursor.fetchall() if cursor.description else []


def run_campaign(
    broker: str,
    messages: int = 2000,
    seed: int = 7,
    *,
    hash_long_keys: bool = False,
    payload: str | None = None,
    deadline_s: float | None = None,
    keep: bool = False,
    save_log: str | None = None,
    say: Callable[[str], None] = lambda text: None,
) -> Report:
    """Send at least ``messages`` copies through a fresh ``oncely consume`` on ``broker`` and
    account for every one (see the module docstring)."""
    started = time.monotonic()
    features = cli_features()
    if hash_long_keys and not features["--hash-long-keys"]:
        raise SystemExit("this oncely consume has no --hash-long-keys")
    flags: list[str] = []
    key_limit = KEY_LIMIT_DEFAULT
    if features["--max-key-bytes"]:
        flags += ["--max-key-bytes", str(KEY_LIMIT_FLAG)]
        key_limit = KEY_LIMIT_FLAG
    if features["--max-body-bytes"]:
        flags += ["--max-body-bytes", str(BODY_CAP)]
    if hash_long_keys:
        flags.append("--hash-long-keys")
    if payload is not None:
        if not features["--payload"]:
            raise SystemExit("this oncely consume has no --payload")
        flags += ["--payload", payload]
    ctx = Ctx(broker, key_limit, BODY_CAP, hash_long_keys, random.Random(seed))
    plan = generate(ctx, messages)
    run = uuid.uuid4().hex[:10]
    fx_table, inbox_table = _fx_tables(run)
    driver = DRIVERS[broker](f"campaign_{run}")
    _sql(
        f"CREATE TABLE {fx_table} (id bigserial PRIMARY KEY, kind text NOT NULL, "
        "cls text NOT NULL, n integer NOT NULL, key text, attempt integer, "
        "at timestamptz DEFAULT clock_timestamp())"
    )
    command = [
        sys.executable, "-m", "oncely.cli", "consume",
        "--broker", driver.url,
        "--source", driver.source,
        "--handler", HANDLER,
        "--store", with_query(POSTGRES_DSN, f"table={inbox_table}"),
        "--consumer", CONSUMER,
        "--mode", "two-phase",
        "--key", KEY_SPEC,
        "--concurrency", str(CONCURRENCY),
        "--ack-wait", f"{ACK_WAIT_S}s",
        "--max-deliveries", str(MAX_DELIVERIES),
        "--shutdown-grace", "10s",
        "--log-format", "json",
        "--log-level", "info",
        *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "ONCELY_CAMPAIGN_DSN": POSTGRES_DSN,
        "ONCELY_CAMPAIGN_TABLE": fx_table,
        "ONCELY_CAMPAIGN_SLOW_S": str(SLOW_S),
    }
    consumer: ConsumerProcess | None = None
    book = LogBook()
    notes: list[str] = []
    violations: list[str] = []
    try:
        driver.prepare()
        consumer = ConsumerProcess(command, env)
        ready_by = time.monotonic() + 30
        while not driver.ready():
            if not consumer.alive() or time.monotonic() > ready_by:
                consumer.stop(5)
                book.feed(consumer.err)
                raise RuntimeError(
                    f"oncely consume did not start on {broker} (exit {consumer.proc.returncode}): "
                    + b"\n".join(consumer.err[-20:]).decode("utf-8", "replace")
                )
            time.sleep(0.1)
        say(f"campaign {broker}: sending {plan.copies} copies of {len(plan.logicals)} messages")
        sent = driver.publish(plan.phase1)
        time.sleep(PHASE_GAP_S)
        sent |= driver.publish(plan.phase2)
        entering = sum(1 for s in sent.values() if s.refused is None and not s.dropped)
        idents = set(sent_idents(sent))
        limit = deadline_s if deadline_s is not None else 30 + 0.04 * plan.copies
        until = time.monotonic() + limit
        done = False
        spelled = {k: id(lg) for lg in plan.logicals for k in lg.spellings}
        copies = {id(lg): len(lg.copies) for lg in plan.logicals}
        heard, quiet_since = 0, time.monotonic()
        while time.monotonic() < until and consumer.alive():
            book.feed(consumer.err)
            if len(book.records) + len(book.bad) != heard:
                heard, quiet_since = len(book.records) + len(book.bad), time.monotonic()
            if driver.identifies_copies:
                answered = len(book.ack_idents & idents)
            else:  # RabbitMQ: lines by key, at most one per copy (redeliveries answer again)
                per = Counter(spelled.get(str(r.get("key")), 0) for r in book.acks)
                answered = sum(min(v, copies.get(k, 0)) for k, v in per.items())
            if answered + driver.dead_count() >= entering and (
                driver.identifies_copies
                or (time.monotonic() - quiet_since > 1.5 and driver.ready_count() == 0)
            ):
                done = True
                break
            time.sleep(0.25)
        time.sleep(0.5)  # the last lines
        book.feed(consumer.err)
        if not done:
            notes.append(f"not every copy had an outcome after {limit:g}s: stopped at the deadline")
        alive = consumer.alive()
        if not alive:
            violations.append(
                f"the consumer process exited during the run (exit {consumer.proc.returncode})"
            )
        exit_code = consumer.stop()
        book.feed(consumer.err)
        if save_log:
            Path(save_log).write_bytes(b"".join(line + b"\n" for line in consumer.err))
        if exit_code != 0:
            violations.append(f"oncely consume exited {exit_code} after SIGTERM (expected 0)")
        if consumer.out:
            violations.append(f"oncely consume wrote to stdout: {short(consumer.out)}")
        if not any("oncely consume stopped" in str(r.get("message")) for r in book.records):
            notes.append("no 'oncely consume stopped' line")
        dead = driver.read_dead()
        left = driver.leftovers()
        fx = Counter(
            {
                (kind, cls, n): count
                for kind, cls, n, count in _sql(
                    f"SELECT kind, cls, n, count(*) FROM {fx_table} GROUP BY 1, 2, 3"
                )
            }
        )
        rows, found, more = account(driver, plan, sent, book, dead, left, fx)
        return Report(
            broker=broker,
            seed=seed,
            messages=messages,
            flags=flags,
            rows=rows,
            violations=violations + found.violations(),
            mismatches=found.mismatches(),
            notes=notes + more,
            reasons=found.reasons,
            alive=alive,
            exit_code=exit_code,
            elapsed_s=time.monotonic() - started,
        )
    finally:
        if consumer is not None:
            consumer.kill()
        if not keep:
            try:
                driver.cleanup()
            except Exception as exc:  # never hide what failed the run
                print(f"campaign: cleaning up {broker} failed: {exc!r}", file=sys.stderr)
            _sql(f"DROP TABLE IF EXISTS {fx_table}, {inbox_table}, {inbox_table}_meta")


def sent_idents(sent: dict[str, Sent]) -> Iterable[str]:
    return (s.ident for s in sent.values() if s.ident is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.campaign",
        description="Send good and bad input through a real `oncely consume`; account for "
        "every message.",
    )
    parser.add_argument("--broker", choices=BROKERS, required=True)
    parser.add_argument("--messages", type=int, default=2000, help="at least this many copies")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hash-long-keys", action="store_true", help="run the consumer with it")
    parser.add_argument("--payload", choices=("body", "data"), help="pass it to the consumer")
    parser.add_argument("--deadline", type=float, help="seconds to wait for every outcome")
    parser.add_argument("--keep", action="store_true", help="leave queues, streams, tables")
    parser.add_argument("--save-log", metavar="PATH", help="write the consumer's stderr there")
    args = parser.parse_args(argv)
    report = run_campaign(
        args.broker,
        args.messages,
        args.seed,
        hash_long_keys=args.hash_long_keys,
        payload=args.payload,
        deadline_s=args.deadline,
        keep=args.keep,
        save_log=args.save_log,
        say=lambda text: print(text, flush=True),
    )
    print(report.render(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
