"""``oncely consume``: run a broker consumer from the command line.

::

    oncely consume --broker amqp://guest:guest@localhost/ --source payments \\
        --handler myapp.handlers:charge --store postgresql://app@db/app --consumer billing

One structured log line per message (``--log-format json`` for one JSON object per line);
SIGTERM or SIGINT stops reading, lets running handlers finish (``--shutdown-grace``), settles
what finished and exits 0.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import click

import oncely
from oncely import RedeliveryHorizon, format_duration
from oncely._repeats import Repeats
from oncely.brokers import (
    BrokerConsumer,
    ConsumerSettings,
    InboxProcessor,
    Processor,
    open_transport,
)
from oncely.brokers._consumer import handler_misfit
from oncely.cli._durations import Duration
from oncely.cli._errors import USAGE, CliError, remember_secrets
from oncely.cli._loading import load_attribute, load_hooks, load_reconciler
from oncely.cli._retention import recommend
from oncely.cli._stores import refuse_missing_directory, store_option
from oncely.cloudevents import event_data
from oncely.errors import ConfigurationError
from oncely.keys import KeySource, KeyWarning, key_source
from oncely.wire import printable

__all__ = ["Consumption", "broker_options", "consume", "read_consumption", "run_consumer"]

ENV_BROKER = "ONCELY_BROKER"


class _UTC(logging.Formatter):
    """Times in UTC, ISO 8601 with milliseconds and ``Z``, whatever the process's time zone
    (Django sets it from ``TIME_ZONE``): one consumer's lines sort with every other's."""

    def formatTime(  # noqa: N802 (logging's name)
        self, record: logging.LogRecord, datefmt: str | None = None
    ) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"


class JSONLines(_UTC):
    """One JSON object per record: time, level, logger, message and every ``oncely_*`` field."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name.startswith("oncely_"):
                line[name.removeprefix("oncely_")] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a traceback with its keys hashed (log_keys="hash")
            line["error"] = record.exc_text
        return json.dumps(line, default=str)


def load_handler(spec: str, mode: str = "two-phase") -> Callable[..., Awaitable[Any]]:
    """The ``async def`` named by ``module:function`` (``package.module:object.method``), whose
    arguments fit how ``mode`` calls it (else every message would fail with a TypeError)."""
    target = load_attribute(spec, "--handler")
    if not inspect.iscoroutinefunction(target):
        raise CliError(
            f"--handler {spec!r} must be an async function (async def handler(payload) for "
            "the two-phase mode, async def handler(tx, payload) for the transactional mode)",
            USAGE,
        )
    wrong = handler_misfit(target, "transactional" if mode == "transactional" else "two_phase")
    if wrong is not None:
        raise CliError(f"--handler {spec!r} {wrong}", USAGE)
    return target  # type: ignore[no-any-return]


def _stale_policy(
    mode: str, on_stale: str | None, reconciler_spec: str | None
) -> oncely.OnStale | Callable[[oncely.StaleClaim], Awaitable[oncely.Resolution]]:
    """The inbox's ``on_stale`` from ``--on-stale`` and ``--reconciler`` (one of them)."""
    given = "--reconciler" if reconciler_spec is not None else "--on-stale"
    if reconciler_spec is not None and on_stale is not None:
        raise CliError("give --reconciler or --on-stale, not both", USAGE)
    if mode == "transactional" and (reconciler_spec is not None or on_stale is not None):
        raise CliError(
            f"{given} is for the two-phase mode: in the transactional mode a worker that "
            "dies mid-handler leaves no claim behind (its transaction, the claim with it, "
            "rolls back) and the next delivery simply runs",
            USAGE,
        )
    reconciler = load_reconciler(reconciler_spec)
    if reconciler is not None:
        return reconciler.asynchronous()
    return oncely.OnStale(on_stale or "retry")


class TextLines(_UTC):
    """``time LEVEL message``, one line per record: control characters in the message (a
    key or reason holding a newline) are escaped, so no field can forge a line. A traceback
    still follows on its own lines."""

    def __init__(self, fmt: str = "%(asctime)s %(levelname)s %(message)s") -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)


class _NotOutcomes(logging.Filter):
    """Drops the inbox's own outcome lines (the consumer logs one line per message with the
    broker action); keeps everything else it logs (a result not stored, a failing hook)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not hasattr(record, "oncely_outcome")


class _SaidByOncely(logging.Filter):
    """Drops the AMQP client's own line for a connection that failed: the consumer's warning
    ("unavailable (...); trying again in ...") says the same, formatted like every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("error when creating transport")


def _configure_logging(log_format: str, level: str) -> None:
    """oncely's records at ``level``, and the client libraries' own (aiokafka, aio-pika,
    nats, botocore...) at WARNING and above, in the same format on stderr (so a JSON log
    stays JSON), each kind of theirs at most once per 30 seconds."""
    ours = logging.StreamHandler(sys.stderr)
    theirs = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        ours.setFormatter(JSONLines())
        theirs.setFormatter(JSONLines())
    else:
        ours.setFormatter(TextLines())
        theirs.setFormatter(TextLines("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    broker_log = logging.getLogger("oncely")
    broker_log.addHandler(ours)
    broker_log.setLevel(level.upper())
    broker_log.propagate = False
    theirs.setLevel(logging.WARNING)
    theirs.addFilter(_SaidByOncely())
    theirs.addFilter(Repeats())
    root = logging.getLogger()
    if not root.handlers:  # a framework's own logging set-up (Django's LOGGING) is kept
        root.addHandler(theirs)


_F = TypeVar("_F", bound=Callable[..., object])


def _options(*options: Callable[[_F], _F]) -> Callable[[_F], _F]:
    def apply(fn: _F) -> _F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


broker_options = _options(
    click.option(
        "--broker",
        "broker_url",
        metavar="URL",
        envvar=ENV_BROKER,
        show_envvar=True,
        required=True,
        help=(
            "amqp://user:pass@host/vhost, redis://host:6379/0, nats://host:4222, "
            "kafka://host:9092 or sqs://REGION (sqs://host:port for a plain-HTTP endpoint)."
        ),
    ),
    click.option(
        "--source",
        required=True,
        metavar="NAME",
        help="What to read: the queue (RabbitMQ, SQS), stream (Redis), subject (NATS) or "
        "topic (Kafka).",
    ),
    click.option("--consumer", required=True, help="The consumer name that scopes records (R5)."),
    click.option(
        "--key",
        "key_spec",
        default="message-id",
        show_default=True,
        help="message-id, cloudevents, header:NAME, body:FIELD or correlation-id "
        "(comma-separated: the first found).",
    ),
    click.option(
        "--max-key-bytes",
        type=click.IntRange(16, 4096),
        default=512,
        show_default=True,
        help="Longest key accepted (UTF-8 bytes); longer ones are dead-lettered (or hashed).",
    ),
    click.option(
        "--hash-long-keys",
        is_flag=True,
        help="Keep a key over --max-key-bytes as its SHA-256 instead of dead-lettering it.",
    ),
    click.option(
        "--max-body-bytes",
        type=click.IntRange(0),
        metavar="N",
        help="Dead-letter a body over N bytes without decoding it (default: no limit).",
    ),
    click.option(
        "--concurrency",
        type=click.IntRange(1, 10_000),
        default=16,
        show_default=True,
        help="Messages handled at once (on Kafka, partitions handled at once; the records of "
        "one partition stay in order), in batch mode across the batches running together.",
    ),
    click.option("--group", help="Consumer group / durable name (default: the consumer name)."),
    click.option(
        "--dead-letter",
        metavar="NAME",
        help="Dead-letter destination (default SOURCE.dead; on SQS the queue's redrive "
        "target, else SOURCE-dead, NAME-dead.fifo for a FIFO queue NAME.fifo).",
    ),
    click.option(
        "--ack-wait", type=Duration(), help="Broker ack wait / idle time before redelivery."
    ),
    click.option(
        "--max-deliveries",
        type=click.IntRange(1, 1000),
        default=5,
        show_default=True,
        help="Deliveries of a failing message before it is dead-lettered with its reason.",
    ),
    click.option(
        "--retention",
        type=Duration(),
        default="7d",
        show_default=True,
        help="How long records are kept; the consumer refuses to start when it is shorter "
        "than its redelivery horizon (printed at start).",
    ),
    click.option(
        "--resubmit-window",
        type=Duration(),
        default="1d",
        show_default=True,
        help="How long after dead-lettering an operator may send a message back; part of the "
        "horizon.",
    ),
    click.option(
        "--message-ttl",
        type=Duration(),
        default=None,
        help="The longest a message may wait in the queue, when the broker cannot say (a "
        "queue policy); part of the horizon.",
    ),
    click.option(
        "--shutdown-grace",
        type=Duration(),
        default="30s",
        show_default=True,
        help="On SIGTERM or SIGINT, how long running handlers may finish; what is still "
        "running then is given back to the broker, never acknowledged.",
    ),
    click.option(
        "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
    ),
    click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default="info",
        show_default=True,
    ),
    click.option(
        "--hook",
        "hook_specs",
        multiple=True,
        metavar="MODULE:FUNCTION",
        help="Call FUNCTION(handled) with every outcome (oncely.Handled), for metrics: a plain "
        "def that returns at once; what it raises is logged, never the message's concern. "
        "Repeatable.",
    ),
    click.option(
        "--log-keys",
        type=click.Choice(["plain", "hash"]),
        default="plain",
        show_default=True,
        help="hash: log a digest of each key (h:<hex>), never the key itself (keys that are "
        "personal data).",
    ),
    click.option(
        "--tracing",
        is_flag=True,
        help="An OpenTelemetry span per message, continuing the producer's trace from its "
        "headers, through the global tracer provider (run under opentelemetry-instrument, or "
        "configure the SDK in the handler's module). Needs oncely[otel].",
    ),
)
"""The options of every consume command: the broker, the key, the limits, the horizon and
the logs (``oncely consume`` and ``manage.py oncely consume`` add how the handler runs)."""


@dataclass(frozen=True)
class Consumption:
    """What a consume command's :data:`broker_options` say, checked, for the processor."""

    consumer: str
    key: KeySource
    limits: oncely.Limits
    retention: oncely.Retention
    logger: logging.Logger
    log_keys: Literal["plain", "hash"] = "plain"
    hooks: tuple[Callable[[Any], None], ...] = ()


def read_consumption(options: Mapping[str, Any]) -> Consumption:
    """The key source, limits and retention :data:`broker_options`' ``options`` name, or a
    usage error; a key source that is a poor idempotency key is warned about on stderr."""
    key_spec: str = options["key_spec"]
    remember_secrets(options["broker_url"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KeyWarning)
        try:
            key = key_source(key_spec)
        except ConfigurationError as exc:
            raise CliError(f"--key: {exc}", USAGE) from None
    for warning in caught:
        click.echo(f"oncely consume: warning: --key {key_spec}: {warning.message}", err=True)
    try:
        keep = oncely.Retention(keep=options["retention"])
    except ConfigurationError as exc:
        raise CliError(f"--retention: {exc}", USAGE) from None
    limits = oncely.Limits(
        max_key_bytes=options["max_key_bytes"], hash_long_keys=options["hash_long_keys"]
    )
    # The consumer's one line per message carries the outcome; the inbox's own outcome line
    # would repeat it, so only its other lines are shown.
    quiet = logging.getLogger("oncely.cli.inbox")
    quiet.addFilter(_NotOutcomes())
    log_keys: Literal["plain", "hash"] = options.get("log_keys") or "plain"
    hooks = load_hooks(tuple(options.get("hook_specs") or ()))
    return Consumption(options["consumer"], key, limits, keep, quiet, log_keys, hooks)


def run_consumer(
    consumption: Consumption,
    options: Mapping[str, Any],
    processor: Callable[[Consumption], AbstractAsyncContextManager[Processor]],
    *,
    batch: int | None = None,
    purge_every: timedelta | None = None,
) -> None:
    """Run a consumer with :data:`broker_options`' ``options`` until SIGTERM or SIGINT,
    ``processor`` yielding what runs each message (and closing it at the end)."""
    _configure_logging(options["log_format"], options["log_level"])
    transport = open_transport(
        options["broker_url"],
        options["source"],
        group=options["group"] or consumption.consumer,
        dead_letter=options["dead_letter"],
        ack_wait=options["ack_wait"],
    )
    settings = ConsumerSettings(
        concurrency=options["concurrency"],
        batch=batch,
        max_deliveries=options["max_deliveries"],
        shutdown_grace=options["shutdown_grace"],
        max_body_bytes=options["max_body_bytes"],
        purge_every=purge_every,
        resubmit_window=options["resubmit_window"],
        message_ttl=options["message_ttl"],
    )

    async def run() -> None:
        async with processor(consumption) as made:
            runner = BrokerConsumer(
                transport, made, settings=settings, tracing=bool(options.get("tracing"))
            )
            runner._horizon_advice = _horizon_advice
            await runner.run(handle_signals=True)
        summary = ", ".join(f"{name}={n}" for name, n in sorted(runner.counts.items()))
        logging.getLogger("oncely.broker").info("oncely consume stopped: %s", summary or "idle")

    asyncio.run(run())


def _horizon_advice(horizon: RedeliveryHorizon) -> str:
    """A retention below the consumer's horizon, said in the command's flags."""
    try:
        enough = f"raise --retention to {format_duration(recommend(horizon.total))} (the "
        enough += "horizon and a quarter, as `oncely retention` recommends)"
    except OverflowError:
        enough = "raise --retention"
    return f"{enough}, or lower --max-deliveries, --ack-wait, --message-ttl or --resubmit-window"


@click.command()
@broker_options
@click.option("--handler", "handler_spec", required=True, metavar="MODULE:FUNCTION")
@store_option
@click.option(
    "--mode",
    type=click.Choice(["two-phase", "transactional"]),
    default="two-phase",
    show_default=True,
    help="transactional needs a SQL or DynamoDB store and a handler(tx, payload).",
)
@click.option(
    "--store-offsets",
    is_flag=True,
    help="Kafka, transactional mode: keep each partition's next offset in the handler's "
    "transaction and start from it on assignment (the database says how far the consumer got).",
)
@click.option(
    "--payload",
    type=click.Choice(["body", "data"]),
    default="body",
    show_default=True,
    help="What the handler gets: the decoded body, or a CloudEvent's data (its body in "
    "binary mode, its data field in structured mode).",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 10_000),
    default=None,
    metavar="N",
    help="Read and claim up to N messages together (one claim and one completion per batch); "
    "1: one message at a time (default: the broker's choice, 500 on Kafka, 10 on SQS, 1 "
    "elsewhere).",
)
@click.option(
    "--purge-every",
    type=Duration(),
    default=None,
    help="Also purge expired records every DURATION (e.g. 1m); one consumer of a fleet "
    "leads the purge of a table at a time.",
)
@click.option(
    "--on-stale",
    type=click.Choice(["retry", "escalate"]),
    default=None,
    help="Two-phase mode, a message whose earlier worker died mid-handler (its claim's lease "
    "lapsed): retry runs the handler again (the default); escalate dead-letters it with the "
    "reason and leaves the record for a person (oncely inbox resolve).",
)
@click.option(
    "--reconciler",
    "reconciler_spec",
    metavar="MODULE:FUNCTION",
    help="Two-phase mode: ask reconciler(stale) -> oncely.Resolution (def or async def) "
    "about such a message instead, to look in the external system for its effect (R10); "
    "give `oncely reconcile` the same one.",
)
def consume(
    handler_spec: str,
    store_url: str,
    mode: str,
    store_offsets: bool,
    payload: str,
    batch: int | None,
    purge_every: timedelta | None,
    on_stale: str | None,
    reconciler_spec: str | None,
    **options: Any,
) -> None:
    """Consume SOURCE from a broker, running HANDLER once per logical message.

    Each outcome becomes one broker action: processed and duplicate are acknowledged;
    in_flight and failed are given back for a later delivery (failed ones dead-lettered after
    --max-deliveries); key_conflict, rejected and escalated go to the dead-letter destination
    with the reason. Stops cleanly on SIGTERM or SIGINT.

    At start it prints its redelivery horizon (how long the broker may still hand out a
    copy, from --max-deliveries, the backoff, the broker's ack wait, delivery limit and
    message time-to-live, and --resubmit-window) and exits 1 if --retention is shorter.

    The broker URL comes from --broker or $ONCELY_BROKER; the store URL from --store or
    $ONCELY_STORE.
    """
    consumption = read_consumption(options)
    remember_secrets(store_url)
    refuse_missing_directory(store_url)  # exit 3, as every command that opens a store
    handler = load_handler(handler_spec, mode)
    stale_policy = _stale_policy(mode, on_stale, reconciler_spec)

    @asynccontextmanager
    async def inbox_processor(run: Consumption) -> AsyncIterator[Processor]:
        if store_url.split(":", 1)[0].lower() == "memory":
            run.logger.warning(
                "oncely consume: the store is memory://, which lives in this process only: "
                "a restart forgets every record, and a redelivery after it runs again (use "
                "SQLite, PostgreSQL, MariaDB/MySQL, Redis or DynamoDB for anything but a trial)"
            )
        store = oncely.open_async(store_url)
        inbox = oncely.AsyncInbox(
            store,
            consumer=run.consumer,
            logger=run.logger,
            log_keys=run.log_keys,
            hooks=run.hooks,
            limits=run.limits,
            retention=run.retention,
            on_stale=stale_policy,
        )
        try:
            yield InboxProcessor(
                inbox,
                handler,
                mode="transactional" if mode == "transactional" else "two_phase",
                key=run.key,
                payload=event_data if payload == "data" else None,
                store_offsets=store_offsets,
            )
        finally:
            try:
                await inbox.aclose()
            finally:
                # The store is the caller's to close (the inbox leaves it open): left to the
                # garbage collector, a MariaDB pool printed tracebacks at every exit.
                await store.aclose()

    run_consumer(consumption, options, inbox_processor, batch=batch, purge_every=purge_every)
