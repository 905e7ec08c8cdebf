"""Operations without a redelivery (R10): ``oncely inbox resolve`` settles one escalated or
stuck record by an operator's decision; ``oncely reconcile`` runs a consumer's reconciler over
its stale in-progress records now. Both are fenced: a live claim is never overridden."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import click

import oncely
from oncely import Resolution, Resolved, Status
from oncely.cli._durations import Duration
from oncely.cli._errors import CHECK_FAILED, USAGE, CliError
from oncely.cli._keys import (
    DEFAULT_LIMIT,
    LONGEST_KEY,
    absent_why,
    ambiguous,
    key_argument,
    key_form_option,
    locate,
    shown_key,
)
from oncely.cli._loading import load_reconciler
from oncely.cli._output import echo_json, lease_state, now_ms, record_dict, safe
from oncely.cli._stores import opened, store_option
from oncely.errors import ConfigurationError, ResolveRefused

__all__ = ["reconcile", "resolve"]

_KEEP_HELP = (
    "How long the settled record is kept at least (R13); a record is never kept for less "
    "than its own retention, which the consumer set when it claimed it."
)


def _inbox(
    store: oncely.Store, consumer: str, keep: timedelta, on_stale: Any = "retry"
) -> oncely.Inbox:
    try:
        return oncely.Inbox(
            store,
            consumer=consumer,
            retention=oncely.Retention(keep=keep),
            on_stale=on_stale,
            # An operator names records as stored: a consumer may have taken keys up to the
            # largest limit (oncely consume --max-key-bytes), and none is refused here.
            limits=oncely.Limits(max_key_bytes=LONGEST_KEY),
        )
    except ConfigurationError as exc:
        raise CliError(str(exc), USAGE) from None


def _resolved_dict(done: Resolved) -> dict[str, Any]:
    now = now_ms()
    return {
        "key": done.key,
        "action": done.action,
        "detail": done.detail,
        "before": None if done.before is None else record_dict(done.before, full=False, now=now),
        "after": None if done.after is None else record_dict(done.after, full=False, now=now),
    }


def _state(record: oncely.Record | None) -> str:
    if record is None:
        return "absent"
    if record.status is Status.IN_PROGRESS:
        return f"in_progress ({lease_state(record, now_ms())})"
    return record.status.value


# ------------------------------------------------------------------------------ resolve


def _finite(constant: str) -> float:
    """Python's JSON reader takes NaN and Infinity, which JSON has not: a result holding one
    could not be read back by another JSON reader (a duplicate's caller in another language)."""
    raise ValueError(f"{constant} is not a JSON number")


def _finite_float(number: str) -> float:
    """A JSON number as a float, refusing one too large for a double (``1e999``): Python
    reads it as infinity, which would be stored, and answered, as ``Infinity``."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is too large for a JSON reader (it reads as infinity)")
    return value


@click.command()
@store_option
@click.option("--consumer", required=True, help="The consumer the record belongs to.")
@key_argument
@click.option(
    "--completed",
    "completed",
    metavar="JSON",
    help="Record the effect as done, with this JSON as the result its duplicates get.",
)
@click.option("--failed", "failed", metavar="REASON", help="Record a poison message.")
@click.option(
    "--retry", is_flag=True, help="Delete the record so the next delivery runs the handler."
)
@click.option("--note", help="Kept on a completed record (default: resolved by an operator).")
@click.option(
    "--create",
    is_flag=True,
    help="With --completed or --failed: write the record when KEY has none (a message not "
    "delivered yet, settled ahead of it).",
)
@key_form_option
@click.option("--keep", type=Duration(), default="7d", show_default=True, help=_KEEP_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def resolve(
    store_url: str,
    consumer: str,
    key: str,
    hashed: bool | None,
    completed: str | None,
    failed: str | None,
    retry: bool,
    note: str | None,
    create: bool,
    keep: timedelta,
    as_json: bool,
) -> None:
    """Settle KEY's record by hand: an escalated or stuck claim, a poison message fixed.

    --completed JSON records the effect as done (deliveries of KEY become duplicates answered
    with JSON); --failed REASON records a poison message (deliveries are rejected); --retry
    deletes the record so the next delivery (or a resubmission from the dead-letter queue)
    runs the handler. An in-progress record is taken over first, which the store refuses
    while a worker holds a live lease: a running worker is never overridden.

    Exits 1, changing nothing, when a live claim holds the record (or took it meanwhile: a
    record is deleted only while it is the one read), it is already settled that way (a
    completed record: `oncely inbox forget` it to run it again), there is nothing to retry,
    or KEY has no record and --create was not given (a mistyped key would otherwise
    become a completed record, and the real message a duplicate that never runs).
    """
    chosen = [name for name, given in (("--completed", completed is not None),
              ("--failed", failed is not None), ("--retry", retry)) if given]  # fmt: skip
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --completed JSON, --failed REASON, --retry")
    if completed is not None:
        try:
            value = json.loads(completed, parse_constant=_finite, parse_float=_finite_float)
            resolution = Resolution.completed(value)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="'--completed'") from None
    elif failed is not None:
        if not failed.strip():
            raise click.BadParameter("give a reason", param_hint="'--failed'")
        resolution = Resolution.failed(failed)
    else:
        resolution = Resolution.retry()
    with opened(store_url) as store:
        inbox = _inbox(store, consumer, keep)
        found = locate(store, consumer, key, hashed)
        if found.record is None and retry:
            raise CliError(
                f"not resolved: consumer {consumer!r} has no record for key "
                f"{shown_key(found)}: there is nothing to retry, its next delivery runs the "
                f"handler ({absent_why(store, consumer)})",
                CHECK_FAILED,
            )
        if found.record is None:
            if not create:
                raise CliError(
                    f"not resolved: consumer {consumer!r} has no record for key "
                    f"{shown_key(found)} ({absent_why(store, consumer)}; check the key with "
                    "`oncely inbox list`; --create writes one for a message not delivered yet)",
                    CHECK_FAILED,
                )
            if ambiguous(key, hashed):
                raise click.UsageError(
                    f"KEY is {len(key.encode())} bytes, over the default --max-key-bytes of "
                    f"{DEFAULT_LIMIT}: its consumer stores it as given, or hashed if it runs "
                    "with --hash-long-keys; say which with --as-given or --hashed"
                )
        try:
            done = inbox.resolve(found.stored, resolution, note=note)
        except ResolveRefused as refused:
            raise CliError(f"not resolved: {refused}", CHECK_FAILED) from None
    if as_json:
        echo_json(_resolved_dict(done) | {"key_hashed": found.hashed})
        return
    shown = f"consumer {consumer!r}, key {shown_key(found)}"
    click.echo(f"resolved {shown}: {_state(done.before)} -> {_state(done.after)}")
    if done.action == "retry":
        click.echo("its next delivery runs the handler")


# ---------------------------------------------------------------------------- reconcile


@click.command()
@store_option
@click.option("--consumer", required=True, help="The consumer whose stale claims to settle.")
@click.option(
    "--reconciler",
    "reconciler_spec",
    metavar="MODULE:FUNCTION",
    help="The consumer's reconciler: reconciler(stale) -> oncely.Resolution (def or async def).",
)
@click.option(
    "--on-stale",
    type=click.Choice(["retry", "escalate"]),
    help="Without a reconciler: retry deletes each stale claim (its next delivery runs the "
    "handler), escalate only lists them.",
)
@click.option("--limit", type=click.IntRange(min=1), help="Settle at most N stale claims.")
@click.option("--dry-run", is_flag=True, help="List the stale claims; change nothing.")
@click.option("--keep", type=Duration(), default="7d", show_default=True, help=_KEEP_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def reconcile(
    store_url: str,
    consumer: str,
    reconciler_spec: str | None,
    on_stale: str | None,
    limit: int | None,
    dry_run: bool,
    keep: timedelta,
    as_json: bool,
) -> None:
    """Settle a consumer's stale in-progress records now (their worker's lease lapsed),
    instead of when each message happens to be redelivered.

    The reconciler is asked about each (StaleClaim.payload is None: there is no delivery) and
    its answer applied: completed records the effect as done, retry deletes the claim so the
    next delivery runs the handler, failed records a poison message, escalate leaves it for a
    person. Every write is fenced: a worker that came back to its claim keeps it (skipped).

    Exits 1 when a stale claim was escalated or the reconciler raised for it (a person must
    look); 0 when every one was settled or its worker came back.
    """
    if reconciler_spec is not None and on_stale is not None:
        raise click.UsageError("give --reconciler or --on-stale, not both")
    if reconciler_spec is None and on_stale is None and not dry_run:
        raise click.UsageError("give --reconciler MODULE:FUNCTION or --on-stale retry|escalate")
    reconciler = load_reconciler(reconciler_spec)
    policy: Any = reconciler.sync() if reconciler is not None else (on_stale or "escalate")
    with opened(store_url) as store:
        inbox = _inbox(store, consumer, keep, policy)
        if dry_run:
            found = inbox.stale_claims(limit=limit)
            done = [Resolved(r.key, "stale", r, r, "dry run: nothing changed") for r in found]
        else:
            done = inbox.reconcile(limit=limit)
        # None stale and no record at all: more likely a misspelt name than all settled.
        unknown = (
            "" if done or store.scan(consumer=consumer, limit=1) else absent_why(store, consumer)
        )
    unsettled = [d for d in done if d.action in ("escalate", "error")]
    if as_json:
        echo_json({"consumer": consumer, "stale": len(done), "results": [
            _resolved_dict(d) for d in done]})  # fmt: skip
    else:
        for each in done:
            if dry_run:  # nothing was done: the state it is in, not a change
                click.echo(f"{safe(each.key)}: {_state(each.before)}")
                continue
            click.echo(
                f"{safe(each.key)}: {each.action} ({_state(each.before)} -> "
                f"{_state(each.after)}) {safe(each.detail)}"
            )
        tail = " (dry run: nothing changed)" if dry_run else ""
        if unknown:
            tail += f" ({unknown})"
        click.echo(f"{len(done)} stale claim(s) of consumer {consumer!r}{tail}")
    if unsettled and not dry_run:
        raise CliError(f"{len(unsettled)} stale claim(s) left for a person", CHECK_FAILED)
