"""A batch cut short: the shutdown grace of a consumer in batch mode ran out while some of the
batch's handlers were still running, and the batch's task was cancelled. The handlers that
had finished keep their results; before, their completions (one call for the whole batch,
after the last handler) never happened, their claims stayed in progress, and once the leases
lapsed the redeliveries ran them again (R1, R7, R10)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import oncely
from oncely import Envelope, Outcome


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
def test_r1_r10_a_cancelled_batch_keeps_what_finished_and_frees_what_did_not(
    url: str, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'inbox.db'}" if url == "sqlite" else url
    ran: list[str] = []
    cut_short: list[bool] = []

    async def handler(payload: object) -> str:
        name = str(payload)
        ran.append(name)
        if name.startswith("slow") and not cut_short:
            await asyncio.sleep(30)
        return f"done {name}"

    async def main() -> None:
        store = oncely.open_async(store_url)
        inbox = oncely.AsyncInbox(store, consumer="billing")
        names = ["fast-1", "slow-1", "fast-2", "slow-2", "fast-3"]
        envelopes = [Envelope(body=name, message_id=name) for name in names]
        batch = asyncio.create_task(
            inbox.handle_messages(envelopes, handler, groups=names, concurrency=5)
        )
        while len(ran) < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the fast ones have returned; the slow ones still sleep
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        ran.clear()
        cut_short.append(True)
        again = await inbox.handle_messages(envelopes, handler, groups=names, concurrency=5)
        outcomes = {h.key: h.outcome for h in again}
        expected = {
            "fast-1": Outcome.DUPLICATE,
            "fast-2": Outcome.DUPLICATE,
            "fast-3": Outcome.DUPLICATE,
            "slow-1": Outcome.PROCESSED,  # released as it was cancelled: run at once, once
            "slow-2": Outcome.PROCESSED,
        }
        assert outcomes == expected, outcomes
        assert sorted(ran) == ["slow-1", "slow-2"]
        assert {h.key: h.value for h in again}["fast-2"] == "done fast-2"
        await inbox.aclose()
        await store.aclose()

    asyncio.run(main())
