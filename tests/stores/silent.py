"""What the tests of a SQL store on a server gone silent share (``mysql/test_silent.py``,
``postgres/test_silent.py``): the server is reached through ``tests.brokers.common.Proxy``,
which a test makes silent and then cuts (what it swallowed is lost)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import oncely
from tests.brokers.common import Proxy

SILENT_FOR = 20.0
"""Seconds the relay stays silent at most: far more than the short ``read_timeout`` (1 s),
less than the long one (60 s), which only the relay's cut at the end ends."""


async def assert_cut_while_silent(
    proxy: Proxy,
    task: asyncio.Task[Any],
    match: str,
    what: str = "the statement waited past its read_timeout",
) -> None:
    """``task`` ends within :data:`SILENT_FOR`, the relay still silent, with a
    ``StoreUnavailable`` that matches ``match``; ``what`` says what waited if it did not."""
    done, _ = await asyncio.wait({task}, timeout=SILENT_FOR)
    assert done, what
    assert proxy.silent
    with pytest.raises(oncely.StoreUnavailable, match=match):
        task.result()


async def assert_a_sooner_read_timeout_is_kept_while_a_later_one_waits(
    server_url: str, kind: type[oncely.Store]
) -> None:
    """Two threaded stores (``kind``) on one silent server, reached at ``server_url``
    through a relay: one waits (``read_timeout=60``) when the other, whose bound is far
    sooner (1 s), sends its statement; the second still raises ``StoreUnavailable`` (saying
    so) while the server is silent: the watchdog, asleep until the first's deadline, was
    woken for the sooner one. Once the relay is cut and the server back, both stores work
    again."""
    async with Proxy(server_url) as proxy:
        patient = oncely.open(f"{proxy.url}&read_timeout=60")
        quick = oncely.open(f"{proxy.url}&read_timeout=1")
        assert isinstance(patient, kind) and isinstance(quick, kind)
        try:
            for store in (patient, quick):  # their connections open, and are kept
                assert await asyncio.to_thread(store.get, "c", "k") is None
            proxy.silent = True
            waiting = asyncio.create_task(asyncio.to_thread(patient.get, "c", "k"))
            await asyncio.sleep(0.2)  # the patient one's statement is sent first
            told = asyncio.create_task(asyncio.to_thread(quick.get, "c", "k"))
            await assert_cut_while_silent(proxy, told, r"no answer .* within 1s")
            assert not waiting.done()  # its own bound is a minute
            proxy.silent = False
            proxy.cut()
            with pytest.raises(oncely.StoreUnavailable):
                await waiting
            for store in (patient, quick):  # the pool replaces the cut connections
                assert await _eventually(store) is None
        finally:
            patient.close()
            quick.close()


async def _eventually(store: oncely.Store) -> object:
    for _ in range(100):
        try:
            return await asyncio.to_thread(store.get, "c", "k")
        except oncely.StoreUnavailable:
            await asyncio.sleep(0.2)
    return await asyncio.to_thread(store.get, "c", "k")
