"""The ``twophase`` section of ``bench/run.py``: ``Inbox.handle`` / ``AsyncInbox.handle`` with a
trivial handler, per store, new keys then the same keys again, in interleaved rounds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cases import (
    Keys,
    Resources,
    chunks,
    expect,
    rotated,
    timed,
    timed_async,
    trivial,
    trivial_async,
    us_per,
)

import oncely


@dataclass
class TwoPhaseCase:
    name: str
    is_async: bool
    make: Callable[[Path], Any]  # workdir -> store
    sqlite: bool


def twophase_cases() -> list[TwoPhaseCase]:
    normal = oncely.SQLiteSettings(synchronous="normal")
    cases = [
        TwoPhaseCase("MemoryStore", False, lambda d: oncely.MemoryStore(), False),
        TwoPhaseCase("SQLiteStore (full)", False, lambda d: oncely.SQLiteStore(d / "tp.db"), True),
        TwoPhaseCase(
            "SQLiteStore (normal)",
            False,
            lambda d: oncely.SQLiteStore(d / "tpn.db", settings=normal),
            True,
        ),
        TwoPhaseCase("AsyncMemoryStore", True, lambda d: oncely.AsyncMemoryStore(), False),
        TwoPhaseCase(
            "AsyncSQLiteStore (full)", True, lambda d: oncely.AsyncSQLiteStore(d / "atp.db"), True
        ),
        TwoPhaseCase(
            "AsyncSQLiteStore (normal)",
            True,
            lambda d: oncely.AsyncSQLiteStore(d / "atpn.db", settings=normal),
            True,
        ),
    ]
    return cases


def run_twophase(
    workdir: Path, res: Resources, n: int, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    runner = res.runner
    keys = Keys()
    cases = twophase_cases()
    inboxes: list[Any] = []
    for case in cases:
        store = case.make(workdir)
        if case.is_async:
            inbox = oncely.AsyncInbox(store, consumer="bench")
            res.add_async(store)
            res.add_async(inbox)
        else:
            inbox = oncely.Inbox(store, consumer="bench")
            res.add(store.close)
            res.add(inbox.close)
        inboxes.append(inbox)

    def batch(case: TwoPhaseCase, inbox: Any, msgs: list[tuple[str, Any]]) -> tuple[float, float]:
        """(seconds for new keys, seconds for the same keys again)."""
        if case.is_async:

            async def new() -> None:
                for k, p in msgs:
                    expect(await inbox.handle(k, p, trivial_async), oncely.Outcome.PROCESSED)

            async def dup() -> None:
                for k, p in msgs:
                    expect(await inbox.handle(k, p, trivial_async), oncely.Outcome.DUPLICATE)

            return timed_async(runner, new), timed_async(runner, dup)

        def new_s() -> None:
            for k, p in msgs:
                expect(inbox.handle(k, p, trivial), oncely.Outcome.PROCESSED)

        def dup_s() -> None:
            for k, p in msgs:
                expect(inbox.handle(k, p, trivial), oncely.Outcome.DUPLICATE)

        return timed(new_s), timed(dup_s)

    new: dict[str, list[float]] = {c.name: [] for c in cases}
    dup: dict[str, list[float]] = {c.name: [] for c in cases}
    for case, inbox in zip(cases, inboxes, strict=True):
        batch(case, inbox, keys.batch(warmup))
    for r in range(rounds):
        spent_new = dict.fromkeys(new, 0.0)
        spent_dup = dict.fromkeys(dup, 0.0)
        for c, size in enumerate(chunks(n)):
            for i in rotated(range(len(cases)), r + c):
                a, b = batch(cases[i], inboxes[i], keys.batch(size))
                spent_new[cases[i].name] += a
                spent_dup[cases[i].name] += b
        for name, samples in new.items():
            samples.append(us_per(spent_new[name], n))
            dup[name].append(us_per(spent_dup[name], n))
    rows = []
    for case in cases:
        rows.append({"store": case.name, "path": "new key", "us": new[case.name]})
        rows.append({"store": case.name, "path": "duplicate", "us": dup[case.name]})
    return rows
