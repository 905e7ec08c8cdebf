"""R16 with ``log_keys="hash"`` (keys that are personal data), on every real store: no log
record oncely writes carries the key as it is, the traceback of an error included. A
record's exception is what a formatter prints under the line (and an error tracker reads
whole): a store's error names the key it failed on (``LeaseLost``: ``key 'alice@...'``), and
a handler's or a hook's error may too.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

import oncely
from oncely._core.observe import key_for_logs
from oncely.cli._consume import JSONLines
from oncely.errors import LeaseLost
from tests.backends import Backend, Scope

KEY = "alice@example.com"
HASHED = key_for_logs(KEY, "hash")


def _formatted(records: list[logging.LogRecord]) -> list[str]:
    """Each record as the standard formatter and the CLI's JSON lines print it (the
    traceback included), with its ``oncely_*`` fields."""
    out = []
    for record in records:
        fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
        text = logging.Formatter("%(message)s").format(record)
        out.append(f"{text}\n{JSONLines().format(record)}\n{fields}")
    return out


def _no_key_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    ours = [r for r in caplog.records if r.name.startswith("oncely")]
    assert ours, "nothing was logged"
    lines = _formatted(ours)
    for line in lines:
        assert KEY not in line, line
    return lines


def test_r16_a_store_error_raised_by_the_handler_shows_the_key_hashed_in_its_traceback(
    backend: Backend, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that fails on a real store error naming the key (its renewal with a token
    that does not own the claim: ``LeaseLost``, ``key 'alice@...'``), wrapped in an error of
    its own that names it too: the ``failed`` line's traceback, both errors of the chain,
    shows the key hashed."""
    store = backend.make_sync(scope, None)
    inbox = oncely.Inbox(store, consumer="billing", log_keys="hash")
    said: list[str] = []
    try:

        def charge(payload: dict[str, Any]) -> None:
            try:
                store.renew("billing", KEY, token="not-ours", lease_ms=30_000, keep_ms=60_000)
            except LeaseLost as lost:
                said.append(str(lost))
                raise RuntimeError(f"could not charge {KEY}") from lost

        with caplog.at_level(logging.INFO, logger="oncely"):
            handled = inbox.handle(KEY, {"amount": 1}, charge)
        assert handled.outcome is oncely.Outcome.FAILED
        assert said and KEY in said[0]  # the store's error names the key
        lines = _no_key_in(caplog)
        failed = [line for line in lines if "Traceback" in line and "RuntimeError" in line]
        assert failed, lines
        assert all(f"could not charge {HASHED}" in line for line in failed)
        assert all(f"key {HASHED!r}" in line for line in failed)  # the LeaseLost, chained
        assert all('"error": "Traceback' in line for line in failed)  # the CLI's JSON too
    finally:
        inbox.close()
        store.close()


def test_r16_a_hook_that_raises_naming_the_key_is_logged_with_it_hashed(
    backend: Backend, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    def hook(handled: oncely.Handled[Any]) -> None:
        raise ValueError(f"no metric for {handled.key}")

    store = backend.make_sync(scope, None)
    inbox = oncely.Inbox(store, consumer="billing", log_keys="hash", hooks=[hook])
    try:
        with caplog.at_level(logging.INFO, logger="oncely"):
            assert inbox.handle(KEY, {"amount": 1}, lambda p: 1).outcome is oncely.Outcome.PROCESSED
        lines = _no_key_in(caplog)
        assert any(f"ValueError: no metric for {HASHED}" in line for line in lines), lines
    finally:
        inbox.close()
        store.close()


def test_r16_plain_keys_keep_the_error_itself_on_the_record(
    backend: Backend, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``log_keys="plain"`` (the default) the record carries the exception as before,
    for a formatter or an error tracker to read."""
    store = backend.make_sync(scope, None)
    inbox = oncely.Inbox(store, consumer="billing")
    try:

        def fails(payload: dict[str, Any]) -> None:
            raise RuntimeError(f"could not charge {KEY}")

        with caplog.at_level(logging.INFO, logger="oncely"):
            inbox.handle(KEY, {"amount": 1}, fails)
        [record] = [r for r in caplog.records if getattr(r, "oncely_outcome", None) == "failed"]
        assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
        line = json.loads(JSONLines().format(record))
        assert KEY in line["error"] and line["key"] == KEY
    finally:
        inbox.close()
        store.close()
