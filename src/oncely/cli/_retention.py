"""``oncely retention``: how long to keep dedup records for a given broker (R13)."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta
from typing import Final

import click

from oncely import RedeliveryHorizon, Retention, format_duration
from oncely.brokers._shape import BrokerLimits, ConsumerSettings
from oncely.cli._durations import Duration
from oncely.cli._errors import CHECK_FAILED, CliError
from oncely.cli._output import console, echo_json, text
from oncely.errors import RetentionTooShort

__all__ = ["consumer_horizon", "recommend", "retention"]

MARGIN: Final = 0.25
_HOUR: Final = timedelta(hours=1)
_DAY: Final = timedelta(days=1)


def recommend(horizon: timedelta) -> timedelta:
    """A retention for ``horizon``: a quarter more, rounded up to a whole hour (a whole day
    from one day on), and at least one hour.

    The margin absorbs clock skew between hosts and a broker setting raised later without
    anyone revisiting retention; rounding keeps the number easy to write down.
    """
    wanted = horizon * (1 + MARGIN)
    unit = _DAY if wanted >= _DAY else _HOUR
    return max(unit * math.ceil(wanted / unit), _HOUR)


def consumer_horizon(
    *,
    max_deliveries: int,
    lock: timedelta,
    message_ttl: timedelta,
    resubmit_window: timedelta,
) -> RedeliveryHorizon:
    """The horizon ``oncely consume`` checks at start with these numbers (``lock``: its
    ``--ack-wait``), its retry delays included: one formula for both commands."""
    settings = ConsumerSettings(
        max_deliveries=max_deliveries, resubmit_window=resubmit_window, message_ttl=message_ttl
    )
    return settings.horizon(BrokerLimits(ack_wait=lock))


def _python(keep: timedelta) -> str:
    if keep % _DAY == timedelta(0):
        return f"timedelta(days={keep // _DAY})"
    return f"timedelta(hours={keep // _HOUR})"


@click.command()
@click.option(
    "--max-deliveries",
    type=click.IntRange(min=1),
    required=True,
    help="The broker's maximum delivery count before it dead-letters a message.",
)
@click.option(
    "--lock",
    type=Duration(),
    required=True,
    help="How long one delivery holds the message: lock duration, visibility timeout, ack wait.",
)
@click.option(
    "--message-ttl",
    type=Duration(),
    required=True,
    help="How long a message may wait in the queue before the broker drops it.",
)
@click.option(
    "--redelivery-delay",
    type=Duration(),
    default=None,
    help="The pause before each redelivery (back-off); default: oncely consume's, the "
    "longest it asks for (1s doubling up to 1m). 0s for a broker that redelivers at once.",
)
@click.option(
    "--resubmit-window",
    type=Duration(),
    default="1d",
    show_default=True,
    help="How long after dead-lettering operators may resubmit a message (as oncely "
    "consume's --resubmit-window).",
)
@click.option(
    "--keep",
    type=Duration(),
    default=None,
    help="A retention to check: exit 1 if it is shorter than the horizon.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def retention(
    max_deliveries: int,
    lock: timedelta,
    message_ttl: timedelta,
    redelivery_delay: timedelta | None,
    resubmit_window: timedelta,
    keep: timedelta | None,
    as_json: bool,
) -> None:
    """Compute the redelivery horizon of a broker and the retention it needs (R13).

    A dedup record must outlive every copy of its message the broker can still deliver:

    \b
      horizon = message_ttl + max_deliveries x (lock + redelivery_delay)
                + resubmit_window

    Deleting a record earlier lets a late redelivery through as new. Durations are written
    like 30s, 5m, 2h, 3d, 1d12h or 250ms. The recommendation adds a quarter and rounds up.
    The defaults are oncely consume's, so the same numbers give the horizon it checks at
    start (--lock is its --ack-wait).

    \b
    Example:
      oncely retention --max-deliveries 10 --lock 5m --message-ttl 3d --keep 7d
    """
    horizon = consumer_horizon(
        max_deliveries=max_deliveries,
        lock=lock,
        message_ttl=message_ttl,
        resubmit_window=resubmit_window,
    )
    if redelivery_delay is not None:
        horizon = replace(horizon, redelivery_delay=redelivery_delay)
    try:
        total = horizon.total
        recommended = recommend(total)
    except OverflowError:
        raise click.UsageError(
            "that horizon is longer than any retention can be; check the durations"
        ) from None
    # Retention itself is the judge: the same check oncely runs when an Inbox is configured.
    Retention(keep=recommended, horizon=horizon)
    problem: str | None = None
    if keep is not None:
        if keep <= timedelta(0):
            raise click.BadParameter(
                "must be positive: every record must expire", param_hint="'--keep'"
            )
        try:
            Retention(keep=keep, horizon=horizon)
        except RetentionTooShort as exc:
            problem = str(exc)
    if as_json:
        echo_json(
            {
                "horizon": format_duration(total),
                "horizon_ms": total // timedelta(milliseconds=1),
                "formula": horizon.explain(),
                "recommended": format_duration(recommended),
                "recommended_ms": recommended // timedelta(milliseconds=1),
                "keep": None if keep is None else format_duration(keep),
                "keep_ok": None if keep is None else problem is None,
            }
        )
    else:
        out = console()
        out.print(text(f"redelivery horizon     {format_duration(total)}"))
        out.print(text(f"  = {horizon.explain()}"))
        out.print(
            text(
                f"recommended retention  {format_duration(recommended)} "
                f"(horizon + {MARGIN:.0%}, rounded up)"
            )
        )
        out.print(text(f"  oncely.Retention(keep={_python(recommended)}, horizon=...)"))
        if keep is not None and problem is None:
            spare = format_duration(keep - total)
            verdict = f"retention {format_duration(keep)} covers the horizon ({spare} to spare)"
            if keep < recommended:
                verdict += f"; below the recommended {format_duration(recommended)} margin"
            out.print(text(verdict, "green"))
    if problem is not None:
        raise CliError(problem, CHECK_FAILED)
