"""The ``db`` fixture of the command-line tests: a migrated SQLite file with a known set of
records, made through the real :class:`oncely.Inbox` and store API."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from tests.backends import BACKENDS, Scope
from tests.cli.helpers import PAST, TOKEN, charge, refuse


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A migrated SQLite file holding a known set of records:

    * billing: order-1..order-5 completed (JSON results), order-bad failed (poison)
    * email: msg-live in progress under a live lease; msg-stale in progress, lease lapsed
    * files: blob completed with a binary result; ansi completed with escape codes in it
    * a/b (a consumer name with a slash): k1 completed
    * old: 3 expired records (written in 2020 with one day of retention), awaiting a purge
    """
    path = tmp_path / "inbox.db"
    store = oncely.SQLiteStore(path)
    past = oncely.SQLiteStore(path, clock=oncely.FakeClock(PAST))
    try:
        billing = oncely.Inbox(store, consumer="billing")
        for n in range(1, 6):
            assert billing.handle(f"order-{n}", {"amount": n}, charge).outcome is (
                oncely.Outcome.PROCESSED
            )
        assert billing.handle("order-bad", {"amount": -1}, refuse).outcome is (
            oncely.Outcome.REJECTED
        )
        store.claim(
            "email", "msg-live", fingerprint=None, token=TOKEN,
            lease_ms=3_600_000, keep_ms=86_400_000, takeover=False,
        )  # fmt: skip
        # Claimed in 2020 with a one-second lease and retention until far in the future.
        past.claim(
            "email", "msg-stale", fingerprint=None, token=TOKEN,
            lease_ms=1000, keep_ms=100 * 365 * 86_400_000, takeover=False,
        )  # fmt: skip
        files = oncely.Inbox(store, consumer="files", codec=oncely.RawCodec())
        files.handle("blob", "b", lambda _p: b"\x89PNG\x00\xff\x1b[31m" + bytes(100))
        files.handle("ansi", "a", lambda _p: b"\x1b[2Jcleared [bold]screen[/bold]")
        oncely.Inbox(store, consumer="a/b").handle("k1", 1, lambda _p: 1)
        old = oncely.Inbox(past, consumer="old", retention=oncely.Retention(keep=timedelta(days=1)))
        for n in range(3):
            old.handle(f"gone-{n}", n, lambda _p: None)
    finally:
        store.close()
        past.close()
    return path


StoreUrl = tuple[oncely.Store, str, str]
"""A migrated store, the --store URL that names it, and its kind (mysql, postgres, ...)."""


@pytest.fixture(params=["mysql", "postgres", "redis", "sqlite"])
def each_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreUrl]:
    """A migrated store of each kind on the real servers, dropped afterwards."""
    backend = BACKENDS[str(request.param)]
    backend.require()
    scope = Scope(tmp_path=tmp_path, unique=uuid.uuid4().hex[:12])
    made = backend.make_sync(scope, None)
    try:
        made.migrate()
        url = made.url
        if request.param == "postgres":  # its url names the database, not the table
            url += f"?table=oncely_t_{scope.unique}"
        yield made, url, str(request.param)
    finally:
        made.close()
        for finalizer in reversed(scope.finalizers):
            finalizer()
