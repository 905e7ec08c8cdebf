"""``oncely inbox``: look at the dedup records, purge the expired ones, forget one by hand."""

from __future__ import annotations

import inspect
import shlex
import signal
import sys
import time
from datetime import timedelta
from typing import NoReturn

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import oncely
from oncely import Record, Status, Store, StoreStats, format_duration
from oncely._core.inbox_rules import new_token
from oncely.cli._durations import Duration
from oncely.cli._errors import CHECK_FAILED, CliError
from oncely.cli._keys import absent_why, key_argument, key_form_option, locate, shown_key
from oncely.cli._output import (
    console,
    echo_json,
    iso,
    lease_state,
    lease_word,
    now_ms,
    preview,
    record_dict,
    relative,
    safe,
    text,
)
from oncely.cli._stores import opened, store_option
from oncely.stores._purging import PURGE_BATCH, PURGE_PAUSE, purge_options
from oncely.stores.sync_protocols import ForgetsByToken

__all__ = ["inbox"]

_STATUSES = tuple(s.value for s in Status)


@click.group()
def inbox() -> None:
    """Inspect and maintain the dedup records (the inbox) of a store.

    Records are keyed by consumer and message key. Expired records count as absent
    everywhere; `purge` deletes them. Nothing here creates tables: run `oncely migrate` first.

    Every command reads the store from --store URL, else $ONCELY_STORE; with neither it
    opens sqlite:///oncely.db in the current directory, which is rarely the consumer's.
    """


# ------------------------------------------------------------------------------ stats


@inbox.command()
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option(
    "--exact",
    is_flag=True,
    help="Count every record (slow on large tables) instead of estimating from the "
    "database's statistics.",
)
def stats(store_url: str, as_json: bool, exact: bool) -> None:
    """Live records per consumer and status, and expired records awaiting a purge.

    By default the numbers are estimates from the database's own statistics (PostgreSQL's
    planner, InnoDB's row count, SQLite's index counts, a sample of Redis keys), which
    answer in under a second at any size; --exact counts every record. A number shown
    without `~` was counted all the same (a consumer with at most 1,000 records, the
    expired while a purge keeps up).
    """
    with opened(store_url) as store:
        found = _read_stats(store, exact)
    if found.exact:
        _print_exact(store_url, found, as_json)
    else:
        _print_estimate(store_url, found, as_json)


def _read_stats(store: Store, exact: bool) -> StoreStats:
    # A store of a plugin written before ``exact`` existed counts: its answer says so.
    if exact or "exact" not in inspect.signature(store.stats).parameters:
        return store.stats()
    return store.stats(exact=False)


def _print_exact(store_url: str, found: StoreStats, as_json: bool) -> None:
    consumers = {
        consumer: {s.value: by_status.get(s, 0) for s in Status}
        | {"total": sum(by_status.values())}
        for consumer, by_status in sorted(found.counts.items())
    }
    if as_json:
        echo_json(
            {
                "store": oncely.redact(store_url),
                "exact": True,
                "consumers": consumers,
                "total": found.total,
                "expired": found.expired,
            }
        )
        return
    out = console()
    out.print(text(f"Store {oncely.redact(store_url)}"))
    if consumers:
        table = Table(*("consumer", *_STATUSES, "total"))
        for consumer, counts in consumers.items():
            table.add_row(
                text(consumer, "bold"),
                *(str(counts[s]) for s in _STATUSES),
                str(counts["total"]),
            )
        out.print(table)
    else:
        out.print(text("no live records"))
    out.print(text(f"live records: {found.total}; expired, awaiting purge: {found.expired}"))


def _print_estimate(store_url: str, found: StoreStats, as_json: bool) -> None:
    # An estimate counts some numbers outright all the same (a consumer with few records, the
    # expired while a purge keeps up): those are exact, printed as such; `~` marks the others.
    per_consumer = dict(sorted(found.per_consumer.items()))
    per_status = found.per_status
    if as_json:
        echo_json(
            {
                "store": oncely.redact(store_url),
                "exact": False,
                "consumers": {
                    consumer: {s.value: n for s, n in found.counts.get(consumer, {}).items()}
                    | {"total": total}
                    for consumer, total in per_consumer.items()
                },
                "statuses": (
                    None if per_status is None else {s.value: n for s, n in per_status.items()}
                ),
                "total": found.total,
                "expired": found.expired,
                "counted": {
                    "consumers": sorted(found.counted & per_consumer.keys()),
                    "total": found.counted_total,
                    "expired": found.counted_expired,
                },
                "note": found.note,
            }
        )
        return
    estimated = (
        per_status is not None
        or not (found.counted_total and found.counted_expired)
        or not found.counted >= per_consumer.keys()
    )
    out = console()
    out.print(text(f"Store {oncely.redact(store_url)}"))
    if per_consumer:
        table = Table("consumer", "live records")
        for consumer, total in per_consumer.items():
            table.add_row(text(consumer, "bold"), _shown(total, consumer in found.counted))
        out.print(table)
    else:
        out.print(text("no live records" if found.counted_total else "no live records (estimate)"))
    if per_status is not None:
        split = ", ".join(f"{s.value} ~{per_status.get(s, 0)}" for s in Status)
        out.print(text(f"by status, all consumers: {split}"))
    else:
        out.print(text("by status: not estimated on this store (--exact counts them)"))
    live = _shown(found.total, found.counted_total)
    expired = _shown(found.expired, found.counted_expired)
    out.print(text(f"live records: {live}; expired, awaiting purge: {expired}"))
    if found.note:
        out.print(text(f"note: {found.note}"))
    if estimated:
        out.print(
            text(
                "~ marks estimates from the database's statistics; --exact counts every "
                "record (slow on large tables)",
                "dim",
            )
        )


def _shown(n: int, counted: bool) -> str:
    return str(n) if counted else f"~{n}"


# ------------------------------------------------------------------------------- list


def _after(
    after: str | None, after_consumer: str | None, after_key: str | None
) -> tuple[str, str] | None:
    if after is not None and (after_consumer is not None or after_key is not None):
        raise click.UsageError("give either --after CONSUMER/KEY or --after-consumer/--after-key")
    if after is not None:
        consumer, slash, key = after.partition("/")
        if not slash or not consumer:
            raise click.BadParameter(
                "write CONSUMER/KEY (split at the first '/'); for a consumer name that holds a "
                "'/', use --after-consumer and --after-key",
                param_hint="'--after'",
            )
        return consumer, key
    if after_consumer is None and after_key is None:
        return None
    if after_consumer is None:
        raise click.UsageError("--after-key needs --after-consumer")
    return after_consumer, after_key or ""


def _quoted(value: str) -> str:
    """``value`` as one shell word that is printable as shown: ``shlex.quote``, or for a value
    with control characters (which the terminal output escapes, so a pasted cursor would name
    another record and the next page would skip records) bash's ``$'...'`` with escapes."""
    if value.isprintable():
        return shlex.quote(value)
    out: list[str] = []
    for char in value:
        if char in "\\'":
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:  # bash's \xHH is a byte: only ASCII is one character
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return "$'" + "".join(out) + "'"


def _next_options(record: Record) -> str:
    if "/" not in record.consumer:
        return "--after " + _quoted(f"{record.consumer}/{record.key}")
    return f"--after-consumer {_quoted(record.consumer)} --after-key {_quoted(record.key)}"


@inbox.command(name="list")
@store_option
@click.option("--consumer", help="Only this consumer's records.")
@click.option("--status", type=click.Choice(_STATUSES), help="Only records in this status.")
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=50,
    show_default=True,
    help="At most this many records per page.",
)
@click.option(
    "--after",
    metavar="CONSUMER/KEY",
    help="Start after this record (the cursor the previous page printed).",
)
@click.option("--after-consumer", metavar="CONSUMER", help="Start after this consumer ...")
@click.option("--after-key", metavar="KEY", help="... and this key (with --after-consumer).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def list_records(
    store_url: str,
    consumer: str | None,
    status: str | None,
    limit: int,
    after: str | None,
    after_consumer: str | None,
    after_key: str | None,
    as_json: bool,
) -> None:
    """List live records in (consumer, key) order, one page at a time.

    The lease column tells in-progress records apart: live (a worker holds the claim and may
    be running the handler right now) or stale (its lease lapsed: the worker died or
    stalled; see `oncely reconcile --dry-run`). When more records follow, the page ends with
    the cursor for the next one, e.g. `--after billing/order-41`.
    """
    start = _after(after, after_consumer, after_key)
    with opened(store_url) as store:
        # One more than asked for tells whether a next page exists without a second query.
        page = store.scan(
            consumer=consumer,
            status=Status(status) if status is not None else None,
            after=start,
            limit=limit + 1,
        )
    more = len(page) > limit
    page = page[:limit]
    now = now_ms()
    last = page[-1] if more else None
    if as_json:
        echo_json(
            {
                "store": oncely.redact(store_url),
                "records": [record_dict(r, full=False, now=now) for r in page],
                "next": None if last is None else {"consumer": last.consumer, "key": last.key},
            }
        )
        return
    out = console()
    if not page:
        out.print(text("no records"))
        return
    table = Table("consumer", "key", "status", "lease", "attempt", "updated", "expires", "result")
    for record in page:
        table.add_row(
            text(record.consumer),
            text(record.key, "bold"),
            text(record.status.value),
            lease_word(record, now),
            str(record.attempt),
            iso(record.updated_ms),
            relative(record.expires_ms, now),
            "-" if record.result is None else f"{len(record.result)} B",
        )
    out.print(table)
    if last is not None:
        out.print(text(f"more records follow; next page: {_next_options(last)}"))


# ------------------------------------------------------------------------------- show


@inbox.command()
@store_option
@click.option("--consumer", required=True, help="The consumer the record belongs to.")
@key_argument
@key_form_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def show(store_url: str, consumer: str, key: str, hashed: bool | None, as_json: bool) -> None:
    """Show one record in full: status, attempt, times, lease, expiry, fingerprint, error and
    a safe preview of the stored result (binary is shown as hex, never raw).

    KEY is the key as the message carries it, or as `inbox list` prints it; a record its
    consumer stored hashed (--hash-long-keys) is found by the original key too, and shown as
    such. Exits 1 when the consumer has no live record for KEY.
    """
    with opened(store_url) as store:
        found = locate(store, consumer, key, hashed)
        record = found.record
        if record is None:
            raise CliError(
                f"no live record for consumer {consumer!r} and key {shown_key(found)} "
                f"({absent_why(store, consumer)})",
                CHECK_FAILED,
            )
    now = now_ms()
    if as_json:
        echo_json(record_dict(record, full=True, now=now) | {"key_hashed": found.hashed})
        return
    stored = record.key
    if found.hashed:
        stored += (
            f" (stored hashed: the SHA-256 of the {len(key.encode())}-byte key given, which "
            "is over its consumer's --max-key-bytes)"
        )
    rows: list[tuple[str, str]] = [
        ("consumer", record.consumer),
        ("key", stored),
        ("status", record.status.value),
        ("attempt", str(record.attempt)),
        ("created", iso(record.created_ms)),
        ("updated", iso(record.updated_ms)),
        ("lease", lease_state(record, now)),
        ("expires", f"{iso(record.expires_ms)} ({relative(record.expires_ms, now)})"),
        ("fingerprint", record.fingerprint or "-"),
        ("token", record.token),
        ("error", record.error if record.error is not None else "-"),
    ]
    if record.result is None:
        rows.append(("result", "-"))
    else:
        encoding, shown = preview(record.result)
        rows.append(("result", f"{len(record.result)} bytes, {encoding}"))
        rows.append(("preview", shown))
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        click.echo(name.ljust(width) + safe(value))


# ------------------------------------------------------------------------------ purge


@inbox.command()
@store_option
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=PURGE_BATCH,
    show_default=True,
    help="Records deleted per short write transaction.",
)
@click.option(
    "--max-batches",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many batches (default: until none are left).",
)
@click.option(
    "--every",
    type=Duration(),
    default=None,
    help="Run as a service: purge again every DURATION (e.g. 1m) until stopped. Among "
    "several purges of one table, one leads at a time; the others wait their turn. The "
    "first run's failure ends it (exit 3 or 4); later ones are logged and retried.",
)
@click.option(
    "--pause",
    type=click.FloatRange(0, 100),
    default=PURGE_PAUSE,
    show_default=True,
    help="Rest after each batch for this many times the batch's own time: 1 leaves the "
    "database to the consumers half the time, 0 purges as fast as it can.",
)
def purge(
    store_url: str,
    batch_size: int,
    max_batches: int | None,
    every: timedelta | None,
    pause: float,
) -> None:
    """Delete expired records, in batches, and print how many were deleted.

    Safe to run at any time (from cron, or as a service with --every): expired records
    already count as absent. On a terminal a one-off purge shows its progress.
    """
    if every is not None and max_batches is not None:
        # A service purges until none are left at each run; a cap would be ignored silently.
        raise click.UsageError("--max-batches is for a one-off purge; --every runs a service")
    with opened(store_url) as store:
        if every is not None:
            _purge_service(
                oncely.PurgeService(store, every=every, batch_size=batch_size, pause=pause)
            )
            return
        if max_batches is not None:
            options = purge_options(
                store, batch_size=batch_size, max_batches=max_batches, pause=pause
            )
            deleted = store.purge_expired(**options)
        else:
            once = timedelta(seconds=1)
            deleted = _purge_with_progress(
                oncely.PurgeService(store, every=once, batch_size=batch_size, pause=pause)
            )
    click.echo(f"purged {deleted} expired record{'s' if deleted != 1 else ''}")


def _purge_with_progress(service: oncely.PurgeService) -> int:
    if not sys.stderr.isatty():
        return service.run_once().deleted
    done = [0, 0]
    started = time.monotonic()
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True,
        console=Console(stderr=True),
    ) as progress:  # fmt: skip
        task = progress.add_task("purging")

        def batch(taken: int, deleted: int) -> None:
            done[0] += taken
            done[1] += deleted
            rate = done[1] / max(time.monotonic() - started, 1e-6)
            progress.update(
                task, description=f"purged {done[1]:,} of {done[0]:,} looked at ({rate:,.0f}/s)"
            )

        service.on_batch = batch
        return service.run_once().deleted


def _purge_service(service: oncely.PurgeService) -> None:
    every = service.every

    def report(run: oncely.PurgeRun) -> None:
        if run.leader:
            click.echo(
                f"purged {run.deleted} expired record{'s' if run.deleted != 1 else ''} in "
                f"{run.seconds:.2f}s ({run.rows_per_s:,.0f}/s); next in {format_duration(every)}"
            )
        else:
            click.echo(f"another purge leads; next try in {format_duration(every)}")

    service.on_run = report
    previous = signal.signal(signal.SIGTERM, lambda *_: service.stop())
    try:
        # The first run's error ends the command (a store down, a table missing or of another
        # revision: exit 3 or 4), as `oncely consume` refuses to start; a service that
        # started would log it at each run and purge nothing, looking healthy. Later
        # failures are logged and ridden out.
        service.run_once()
        service.run(first_after=every)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    click.echo("purge service stopped")


# ----------------------------------------------------------------------------- forget


@inbox.command()
@store_option
@click.option("--consumer", required=True, help="The consumer the record belongs to.")
@key_argument
@key_form_option
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--force",
    is_flag=True,
    help="Delete even a live claim, whose worker may be running the handler right now.",
)
def forget(
    store_url: str, consumer: str, key: str, hashed: bool | None, yes: bool, force: bool
) -> None:
    """Delete one record (an operator's decision).

    The next delivery of KEY to this consumer is processed again as new: do this only when
    you know its effects did not happen (or must happen again). A claim whose worker holds a
    live lease is refused unless --force: its next delivery would run beside the worker. A
    claim is deleted only while it is the one shown (a worker that took it over meanwhile
    keeps it). Exits 1, deleting nothing, if there was no record or it was refused.
    """
    with opened(store_url) as store:
        found = locate(store, consumer, key, hashed)
        shown = f"consumer {consumer!r}, key {shown_key(found)}"
        record = found.record
        if record is None:
            raise CliError(f"no record for {shown} ({absent_why(store, consumer)})", CHECK_FAILED)
        live = record.status is Status.IN_PROGRESS and record.is_live(now_ms())
        state = record.status.value
        if record.status is Status.IN_PROGRESS:
            state += f", lease {lease_state(record, now_ms())}"
        if live and not force:
            raise CliError(
                f"not forgotten: {shown} is a live claim ({state}): a worker may be running "
                "its handler, and its next delivery would run beside it; stop the worker or "
                "let the lease lapse (`oncely inbox resolve --retry` then takes it over "
                "safely), or give --force",
                CHECK_FAILED,
            )
        if not yes:
            click.confirm(
                f"Delete the record of {shown} ({state})? Its next delivery will be "
                "processed again",
                abort=True,
                err=True,
            )
        _delete(store, record, shown)
    click.echo(f"forgot the record of {shown}")


def _delete(store: Store, record: Record, shown: str) -> None:
    """Delete ``record`` as it was shown. A settled record goes by its token (no worker writes
    it again, but it may have expired or been forgotten and claimed afresh by a delivery
    meanwhile: that claim is kept). A claim is deleted only while it is that claim: a stale
    one is taken over first, which the store refuses if its worker came back (renewed) or
    another took it over; a live one (--force) by its token."""
    if record.status is not Status.IN_PROGRESS:
        if not isinstance(store, ForgetsByToken):  # a plugin's store: unfenced
            existed = store.forget(record.consumer, record.key)
        else:
            try:
                existed = store.forget_by_token(record.consumer, record.key, token=record.token)
            except oncely.LeaseLost as lost:
                _changed(shown, lost.current)
    else:
        token = record.token
        if record.is_stale(now_ms()):
            token = new_token()
            taken = store.takeover(
                record.consumer, record.key, expected_token=record.token,
                fingerprint=record.fingerprint, token=token, lease_ms=_HOLD_MS,
                keep_ms=max(record.expires_ms - record.updated_ms, _HOLD_MS),
            )  # fmt: skip
            if not taken.won:
                _changed(shown, taken.record)
        try:
            existed = store.release(record.consumer, record.key, token=token)
        except oncely.LeaseLost as lost:
            _changed(shown, lost.current)
    if not existed:
        raise CliError(f"no record for {shown} (it expired meanwhile)", CHECK_FAILED)


_HOLD_MS = 60_000
"""The lease of the claim ``forget`` takes over, only to delete it."""


def _changed(shown: str, now: Record | None) -> NoReturn:
    state = "absent" if now is None else f"{now.status.value}, attempt {now.attempt}"
    if now is not None and now.status is Status.IN_PROGRESS:
        state += f", lease {lease_state(now, now_ms())}"
    raise CliError(
        f"not forgotten: the record of {shown} changed meanwhile (now {state}); its worker "
        "came back or another took it over: look again with `oncely inbox show`",
        CHECK_FAILED,
    )
