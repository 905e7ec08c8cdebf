"""``manage.py oncely consume``: ``oncely consume`` whose handler is a plain Django function
run by :class:`~oncely.integrations.django.consumer.AtomicProcessor` on a database of
``settings.DATABASES``; and the ``oncely`` command group with it in place of the CLI's own."""

from __future__ import annotations

import copy
import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import click

from oncely.brokers import Processor
from oncely.cli._app import cli
from oncely.cli._consume import Consumption, broker_options, read_consumption, run_consumer
from oncely.cli._errors import USAGE, CliError
from oncely.cli._loading import load_attribute
from oncely.integrations.django.consumer import AtomicProcessor, atomic_misfit
from oncely.integrations.django.databases import get_inbox

__all__ = ["django_cli"]


def load_sync_handler(spec: str) -> Callable[[Any], object]:
    """The plain function named by ``module:function``: Django's ORM is synchronous; and it
    takes the payload alone (else every message would fail with a TypeError and be
    dead-lettered), as :class:`AtomicProcessor` checks too."""
    target = load_attribute(spec, "--handler")
    if inspect.iscoroutinefunction(target) or not callable(target):
        raise CliError(
            f"--handler {spec!r} must be a plain function, def handler(payload): its ORM "
            "writes commit in the transaction that records the message",
            USAGE,
        )
    wrong = atomic_misfit(target, "manage.py oncely consume")
    if wrong is not None:
        raise CliError(f"--handler {spec!r} {wrong}", USAGE)
    return target  # type: ignore[no-any-return]


def consume_command(using: str) -> click.Command:
    """``consume`` on the database alias ``using``."""

    @click.command("consume")
    @broker_options
    @click.option(
        "--handler",
        "handler_spec",
        required=True,
        metavar="MODULE:FUNCTION",
        help="def handler(payload), run inside transaction.atomic() with the claim.",
    )
    def consume(handler_spec: str, **options: Any) -> None:
        """Consume SOURCE from a broker, running HANDLER once per logical message in one
        transaction.atomic() with its record on the project's database (--database).

        --concurrency worker threads run handlers, each with its own database connection.
        Each outcome becomes one broker action, as with `oncely consume`: processed and
        duplicate are acknowledged; in_flight and failed are given back (failed ones
        dead-lettered after --max-deliveries); key_conflict and rejected go to the
        dead-letter destination with the reason. Stops cleanly on SIGTERM or SIGINT.

        Expired records are not purged here: run `manage.py oncely inbox purge --every 1m`.
        """
        consumption = read_consumption(options)
        handler = load_sync_handler(handler_spec)

        @asynccontextmanager
        async def atomic(run: Consumption) -> AsyncIterator[Processor]:
            inbox = get_inbox(
                run.consumer,
                using=using,
                logger=run.logger,
                log_keys=run.log_keys,
                hooks=run.hooks,
                limits=run.limits,
                retention=run.retention,
            )
            processor = AtomicProcessor(
                inbox, handler, key=run.key, using=using, threads=options["concurrency"]
            )
            try:
                yield processor
            finally:
                processor.close()

        run_consumer(consumption, options, atomic)

    return consume


def django_cli(using: str) -> click.Group:
    """The ``oncely`` group, its ``consume`` running Django handlers on ``using``."""
    group = copy.copy(cli)
    group.commands = {**cli.commands, "consume": consume_command(using)}
    return group
