"""Errors logged under ``log_keys="hash"`` show the key hashed wherever they are logged from:
a claim's ending that fails after its HTTP client went away, and an inbox logging through a
``logging.LoggerAdapter`` (R16)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import oncely
from oncely._core.observe import key_for_logs
from oncely.errors import LeaseLost
from oncely.http import _to_its_end

KEY = "alice@example.com"


async def test_r16_an_ending_that_fails_after_its_request_was_cancelled_hashes_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request is cancelled (its client went away) while its claim's ending runs on; the
    ending then fails with a ``LeaseLost`` naming the key. Its traceback was logged with the
    key as it is."""
    caplog.set_level(logging.ERROR, logger="oncely")
    release = asyncio.Event()

    async def ending() -> None:
        await release.wait()
        raise LeaseLost(f"complete did not apply: key {KEY!r} is held by another owner", None)

    request = asyncio.ensure_future(_to_its_end(ending(), KEY, "hash"))
    await asyncio.sleep(0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    release.set()
    for _ in range(20):  # the ending's task ends, then its done callback logs
        await asyncio.sleep(0)
    lines = [r for r in caplog.records if "client went away" in r.getMessage()]
    assert len(lines) == 1
    text = logging.Formatter().format(lines[0])
    assert "LeaseLost" in text and repr(key_for_logs(KEY, "hash")) in text
    assert KEY not in text


def test_r16_an_inbox_logging_through_a_logger_adapter_hashes_the_key_in_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An inbox given a ``LoggerAdapter`` under ``log_keys="hash"``: the first error it
    logged raised ``AttributeError`` (an adapter makes no records) after the handler ran."""
    caplog.set_level(logging.INFO, logger="oncely.adapted")
    adapter: Any = logging.LoggerAdapter(logging.getLogger("oncely.adapted"), {})
    inbox = oncely.Inbox(oncely.open("memory://"), consumer="c", logger=adapter, log_keys="hash")

    def handler(_payload: object) -> None:
        raise ValueError(f"no account for {KEY}")

    handled = inbox.handle(KEY, {"n": 1}, handler)
    assert handled.outcome is oncely.Outcome.FAILED
    failed = [r for r in caplog.records if r.getMessage().startswith("failed ")]
    assert len(failed) == 1
    text = logging.Formatter().format(failed[0])
    assert "ValueError: no account for" in text and KEY not in text
