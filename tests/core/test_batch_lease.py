"""A batch that outlasts its lease (R10): every claim it holds is renewed until the batch
completes or releases it, so another worker's copy meets a live claim (``in_flight``) and
is never run a second time. Real SQLite store, real asyncio and thread timing."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from pathlib import Path

import oncely

LEASE = oncely.Lease(duration=timedelta(seconds=1))


async def test_r10_a_batch_longer_than_its_lease_keeps_every_claim_it_holds(
    tmp_path: Path,
) -> None:
    """``fast`` returns at once and waits for the batch's end to be completed; ``later``
    waits behind ``slow`` in its group. Before, both claims lapsed after one lease, and a
    second worker's copy of each was taken over and run again (``stale_reclaimed``)."""
    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    first = oncely.AsyncInbox(store, consumer="c", lease=LEASE)
    second = oncely.AsyncInbox(store, consumer="c", lease=LEASE)
    ran: list[str] = []

    async def handler(payload: dict[str, str]) -> str:
        ran.append(payload["k"])
        if payload["k"] == "slow":
            await asyncio.sleep(2.5)  # two and a half leases
        return payload["k"]

    items = [(k, {"k": k}) for k in ("fast", "slow", "later")]
    batch = asyncio.create_task(
        first.handle_batch(items, handler, groups=["a", "b", "b"], concurrency=2)
    )
    await asyncio.sleep(1.6)  # past the first lease of every claim of the batch
    copies = [await second.handle(k, {"k": k}, handler) for k in ("fast", "later")]
    assert [c.outcome for c in copies] == [oncely.Outcome.IN_FLIGHT] * 2, copies
    done = await batch
    assert [d.outcome for d in done] == [oncely.Outcome.PROCESSED] * 3
    assert sorted(ran) == ["fast", "later", "slow"]  # each once
    again = await second.handle("fast", {"k": "fast"}, handler)
    assert again.outcome is oncely.Outcome.DUPLICATE and again.value == "fast"
    await store.aclose()


def test_r10_the_sync_inbox_renews_a_batch_longer_than_its_lease(tmp_path: Path) -> None:
    store = oncely.SQLiteStore(tmp_path / "inbox.db")
    first = oncely.Inbox(store, consumer="c", lease=LEASE)
    second = oncely.Inbox(store, consumer="c", lease=LEASE)
    ran: list[str] = []

    def handler(payload: dict[str, str]) -> str:
        ran.append(payload["k"])
        if payload["k"] == "slow":
            time.sleep(2.5)
        return payload["k"]

    done: list[oncely.Handled[str]] = []
    worker = threading.Thread(
        target=lambda: done.extend(
            first.handle_batch([(k, {"k": k}) for k in ("fast", "slow")], handler)
        )
    )
    worker.start()
    time.sleep(1.6)
    copy = second.handle("fast", {"k": "fast"}, handler)
    assert copy.outcome is oncely.Outcome.IN_FLIGHT, copy
    worker.join(10)
    assert [d.outcome for d in done] == [oncely.Outcome.PROCESSED] * 2
    assert sorted(ran) == ["fast", "slow"]
    first.close()
    second.close()
