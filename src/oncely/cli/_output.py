"""Terminal-safe output: text, records, result previews, JSON.

Keys, consumer names, errors and results come from messages, so they may hold anything but
NUL: markup, escape sequences, binary. Everything shown goes through :func:`safe` (which
escapes what is not printable) and rich :class:`~rich.text.Text` (which never interprets
markup), so a message cannot repaint or drive an operator's terminal.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import click
from rich.console import Console
from rich.text import Text

from oncely import Record, Status, format_duration

__all__ = [
    "console",
    "echo_json",
    "iso",
    "now_ms",
    "preview",
    "record_dict",
    "relative",
    "safe",
    "text",
]

PREVIEW_CHARS: Final = 200
PREVIEW_BYTES: Final = 32
_WIDE: Final = 160


def console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr). Piped output is not wrapped at 80 columns."""
    found = Console(stderr=stderr, highlight=False)
    if not found.is_terminal:
        return Console(stderr=stderr, highlight=False, width=max(found.width, _WIDE))
    return found


def safe(value: str) -> str:
    """``value`` with every non-printable character written as an escape (``\\x1b``)."""
    if value.isprintable():
        return value
    out: list[str] = []
    for char in value:
        if char.isprintable():
            out.append(char)
        else:
            out.append(repr(char)[1:-1])
    return "".join(out)


def text(value: str, style: str = "") -> Text:
    """A rich Text of ``safe(value)``: shown literally, never as markup."""
    return Text(safe(value), style=style)


def echo_json(value: object) -> None:
    """Print ``value`` as one JSON document on stdout (ASCII only: safe on any terminal)."""
    click.echo(json.dumps(value, indent=2, sort_keys=False, ensure_ascii=True))


def now_ms() -> int:
    """The wall clock, to judge leases and expiry of records read from a store."""
    return time.time_ns() // 1_000_000


def iso(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def relative(ms: int, now: int) -> str:
    """``in 6d23h`` or ``3h5m ago``: the two largest units, enough to read at a glance."""
    seconds = abs(ms - now) // 1000
    span = "".join(re.findall(r"[0-9]+[a-z]+", format_duration(timedelta(seconds=seconds)))[:2])
    return f"in {span}" if ms >= now else f"{span} ago"


def preview(data: bytes) -> tuple[str, str]:
    """``(encoding, preview)`` of a stored result: ``utf-8`` text (escaped, at most
    ``PREVIEW_CHARS`` characters) or ``binary`` as the hex of its first ``PREVIEW_BYTES``."""
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError:
        shown = data[:PREVIEW_BYTES].hex(" ")
        return "binary", shown + (" ..." if len(data) > PREVIEW_BYTES else "")
    shown = safe(decoded[:PREVIEW_CHARS])
    return "utf-8", shown + ("..." if len(decoded) > PREVIEW_CHARS else "")


def lease_state(record: Record, now: int) -> str:
    """What the lease means for an operator, in words."""
    if record.status is not Status.IN_PROGRESS:
        return "none (not in progress)"
    if record.is_live(now):
        return f"held until {iso(record.lease_until_ms)} ({relative(record.lease_until_ms, now)})"
    return (
        f"lapsed at {iso(record.lease_until_ms)} ({relative(record.lease_until_ms, now)}): "
        "stale: its worker died or stalled. The next delivery goes through the consumer's "
        "on_stale policy; if that escalated it (its message then went to the dead letters, "
        "and no delivery may come), settle it with `oncely inbox resolve` or `oncely reconcile`"
    )


def lease_word(record: Record, now: int) -> str:
    """The lease in one word, for a table: ``live`` (a worker holds it: may be running the
    handler), ``stale`` (lapsed: its worker died or stalled; escalated or awaiting a
    redelivery or ``oncely reconcile``), ``-`` (not in progress)."""
    if record.status is not Status.IN_PROGRESS:
        return "-"
    return "live" if record.is_live(now) else "stale"


def record_dict(record: Record, *, full: bool, now: int) -> dict[str, Any]:
    """A record as JSON-ready values: times in ISO 8601 (``lease_until`` only while in
    progress), the result as size and preview."""
    found: dict[str, Any] = {
        "consumer": record.consumer,
        "key": record.key,
        "status": record.status.value,
        "attempt": record.attempt,
        "created_at": iso(record.created_ms),
        "updated_at": iso(record.updated_ms),
        # A settled record holds no lease: the one its last claim had means nothing now
        # (a handler quicker than its lease leaves it in the future).
        "lease_until": (
            iso(record.lease_until_ms) if record.status is Status.IN_PROGRESS else None
        ),
        "expires_at": iso(record.expires_ms),
        "fingerprint": record.fingerprint,
        "error": record.error,
        "result_size": len(record.result) if record.result is not None else None,
        "live": record.is_live(now),
        "stale": record.is_stale(now),
    }
    if full:
        found["lease"] = lease_state(record, now)
        found["token"] = record.token
        if record.result is None:
            found["result_encoding"] = None
            found["result_preview"] = None
        else:
            found["result_encoding"], found["result_preview"] = preview(record.result)
    return found
