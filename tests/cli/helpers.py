"""What the ``oncely`` command-line tests (``tests/cli/``) share: the installed executable, the
fixed values the sample database is built from, running a command in this process, reading the
SQLite file back, and the handlers that fill it. The sample database itself is the ``db``
fixture in ``conftest.py``.
"""

from __future__ import annotations

import sqlite3
import sys
from datetime import UTC, datetime
from pathlib import Path

from click.testing import CliRunner, Result

import oncely
from oncely.cli import cli

EXECUTABLE = Path(sys.executable).parent / "oncely"
SECRET = "s3cret-Pa55"
PAST = datetime(2020, 1, 1, tzinfo=UTC)
TOKEN = "ab" * 16


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def run(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Result:
    """``oncely ARGS`` in this process, stdout and stderr apart."""
    # ONCELY_STORE from the developer's shell must not leak into a test.
    environment: dict[str, str | None] = {"ONCELY_STORE": None}
    environment.update(env or {})
    return CliRunner().invoke(cli, list(args), env=environment, input=stdin)


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return list(conn.execute(sql))


def charge(payload: dict[str, int]) -> dict[str, int]:
    return {"charged": payload["amount"]}


def refuse(_payload: object) -> None:
    raise oncely.Reject("amount is negative")


LIVE_KEYS = [
    ("a/b", "k1"),
    ("billing", "order-1"),
    ("billing", "order-2"),
    ("billing", "order-3"),
    ("billing", "order-4"),
    ("billing", "order-5"),
    ("billing", "order-bad"),
    ("email", "msg-live"),
    ("email", "msg-stale"),
    ("files", "ansi"),
    ("files", "blob"),
]


def count(path: Path, consumer: str) -> int:
    found = rows(path, f"SELECT count(*) FROM oncely_inbox WHERE consumer = '{consumer}'")
    return int(str(found[0][0]))


def reconcile_sent(stale: oncely.StaleClaim) -> oncely.Resolution:
    """A reconciler that finds every lapsed e-mail sent (for ``oncely reconcile``)."""
    return oncely.Resolution.completed({"sent": stale.record.key})


async def reconcile_async(stale: oncely.StaleClaim) -> oncely.Resolution:
    return oncely.Resolution.failed(f"bounced: {stale.record.key}")


def reconcile_wrongly(stale: oncely.StaleClaim) -> object:
    """A reconciler that returns what is not a Resolution (a user's slip)."""
    return "done"
