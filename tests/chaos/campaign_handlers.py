"""The handler the bad-input campaign runs through ``oncely consume`` (two-phase mode):
``--handler tests.chaos.campaign_handlers:handle``.

Every call is recorded in a PostgreSQL table (``$ONCELY_CAMPAIGN_DSN``, table
``$ONCELY_CAMPAIGN_TABLE``) so the campaign process can count what the consumer process did:
one ``run`` row per handler call, and one ``effect`` row per effect. The class of a message is
read from its body (``{"cls": "...", "n": 17}``, the ``data`` of a structured CloudEvent, or
``campaign <cls> <n>`` in a text or binary body) and decides what the handler does.
Concurrency is safe: each call takes its own connection from a small pool, and each row is one
autocommitted statement.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import psycopg

import oncely

MARKER = re.compile(rb"campaign ([a-z0-9_]+) ([0-9]+)")
_POOL_SIZE = 8


class _Pool:
    """Up to ``_POOL_SIZE`` autocommit connections, opened on first use (no background
    threads, nothing to close at exit)."""

    def __init__(self) -> None:
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._opened = 0
        self._free: asyncio.Semaphore | None = None

    async def execute(self, sql: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        if self._free is None:
            self._free = asyncio.Semaphore(_POOL_SIZE)
        async with self._free:
            conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                conn = await psycopg.AsyncConnection.connect(
                    os.environ["ONCELY_CAMPAIGN_DSN"], autocommit=True
                )
                self._opened += 1
            try:
                cursor = await conn.execute(sql, params)
                rows = await cursor.fetchall() if cursor.description else []
            except BaseException:
                await conn.close()
                raise
            self._idle.append(conn)
            return rows


_POOL = _Pool()


def identify(payload: object) -> tuple[str, int]:
    """The campaign class and number a payload carries (``("?", -1)`` when none)."""
    if isinstance(payload, dict):
        data = payload.get("data") if "specversion" in payload else None
        source = data if isinstance(data, dict) and "cls" in data else payload
        cls, n = source.get("cls"), source.get("n")
        if isinstance(cls, str) and isinstance(n, int):
            return cls, n
        return "?", -1
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogateescape")
    if isinstance(payload, bytes | bytearray):
        found = MARKER.search(bytes(payload))
        if found:
            return found.group(1).decode(), int(found.group(2))
    return "?", -1


async def _record(kind: str, cls: str, n: int) -> int:
    """Insert one row; the number of ``kind`` rows of this message, this one included."""
    table = os.environ["ONCELY_CAMPAIGN_TABLE"]
    now = oncely.current()
    key = ascii(now.key) if now is not None else None
    attempt = now.attempt if now is not None else None
    rows = await _POOL.execute(
        f"WITH added AS (INSERT INTO {table} (kind, cls, n, key, attempt) "
        "VALUES (%s, %s, %s, %s, %s) RETURNING 1) "
        f"SELECT count(*) + 1 FROM {table} WHERE kind = %s AND cls = %s AND n = %s",
        (kind, cls, n, key, attempt, kind, cls, n),
    )
    return int(rows[0][0])


class Unserialisable:
    """A result no codec can store."""


async def handle(payload: object) -> object:
    """Behave as the message's class says; record every call and every effect."""
    cls, n = identify(payload)
    runs = await _record("run", cls, n)
    if cls == "raise_once" and runs == 1:
        raise RuntimeError(f"campaign: the first attempt of raise_once {n} fails")
    if cls == "raise_always":
        raise RuntimeError(f"campaign: raise_always {n} fails on every attempt ({runs})")
    if cls in ("reject", "reject_repeat"):
        raise oncely.Reject(f"campaign poison {cls} {n}")
    if cls == "slow":
        await asyncio.sleep(float(os.environ.get("ONCELY_CAMPAIGN_SLOW_S", "3.5")))
    await _record("effect", cls, n)
    if cls == "result_unserialisable":
        return {"cls": cls, "n": n, "what": Unserialisable()}
    if cls == "result_oversized":
        size = int(os.environ.get("ONCELY_CAMPAIGN_RESULT_BYTES", str(300 * 1024)))
        return {"cls": cls, "n": n, "blob": "x" * size}
    return {"cls": cls, "n": n}
