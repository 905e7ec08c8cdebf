"""Batch claims (R8) on MariaDB / MySQL: answers equal the reference model's and the
rows written.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely._core.records import ClaimRequest
from oncely._core.state import ClaimEvent, CompleteEvent, FailEvent
from oncely._core.table import RecordTable
from oncely.stores import ClaimStatus
from oncely.stores.mysql.dialect import MAX_KEY_BYTES
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import url
from tests.stores.mysql.helpers import KEEP_MS, LEASE_MS, _server_ms


def _batches_match_the_model(store: Any, clock: oncely.FakeClock, seed: int) -> None:
    """Records in every state (live, stale, completed, failed, expired, absent), then batch
    claims with keys repeated, fingerprints that agree or not, takeover on and off: every
    answer, and then every record, equals the reference model's (the claims made one by one
    at one clock reading). Both paths run: batches of new keys only, and mixed ones."""
    rng = random.Random(seed)
    model = RecordTable()
    keys = [f"k{i}" for i in range(20)] + ["K0", "k0 ", "", "q'uo\\te", "\U0001f600"]
    number = iter(range(1_000_000))

    def event(key: str, lease: int, keep: int, takeover: bool) -> ClaimEvent:
        fp = rng.choice([None, "f", "g"])
        return ClaimEvent("billing", key, fp, f"t{next(number)}", lease, keep, takeover)

    def batch_of(events: list[ClaimEvent], takeover: bool) -> None:
        got = store.claim_many(
            "billing", [ClaimRequest(e.key, e.fingerprint, e.token) for e in events],
            lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=takeover,
        )  # fmt: skip
        assert got == model.claim_many(events, clock.now_ms())

    for round_ in range(12):
        fresh = [f"new-{round_}-{i}" for i in range(rng.randint(1, 6))]
        batch_of([event(rng.choice(fresh), LEASE_MS, KEEP_MS, False) for _ in range(8)], False)
        for key in rng.sample(keys, 8):
            ev = event(key, rng.choice([1_000, LEASE_MS]), rng.choice([2_000, KEEP_MS]), True)
            got = store.claim(
                "billing", key, fingerprint=ev.fingerprint, token=ev.token,
                lease_ms=ev.lease_ms, keep_ms=ev.keep_ms, takeover=True,
            )  # fmt: skip
            assert got == model.claim(ev, clock.now_ms())
            if got.won and rng.random() < 0.5:
                keep = rng.choice([2_000, KEEP_MS])
                if rng.random() < 0.5:
                    done = CompleteEvent(ev.token, b"r", keep)
                    assert store.complete(
                        "billing", key, token=ev.token, result=b"r", keep_ms=keep
                    ) == model.complete("billing", key, done, clock.now_ms())
                else:
                    failed = FailEvent(ev.token, "e", keep)
                    assert store.fail(
                        "billing", key, token=ev.token, error="e", keep_ms=keep
                    ) == model.fail("billing", key, failed, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 500, 1_500, 2_500, LEASE_MS])))
        takeover = rng.random() < 0.7
        batch_of(
            [event(rng.choice(keys), LEASE_MS, KEEP_MS, takeover) for _ in range(25)], takeover
        )
        clock.advance(timedelta(milliseconds=rng.choice([0, 700])))
    now = clock.now_ms()
    assert [store.get("billing", k) for k in keys] == [model.get("billing", k, now) for k in keys]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_r8_batch_claims_match_the_model(table: str, seed: int) -> None:
    clock = oncely.FakeClock()
    store = MySQLStore.from_url(url(table), clock=clock)
    try:
        _batches_match_the_model(store, clock, seed)
    finally:
        store.close()


def test_r8_a_batch_of_new_keys_answers_the_rows_it_wrote(store: MySQLStore) -> None:
    """New keys are not read back: the answers are built from what was sent and the clock
    reading the OK packet carries, and must equal the rows, whatever the keys hold (quotes,
    backslashes, NUL, trailing spaces, case, 4-byte characters), with or without
    fingerprints."""
    odd = ["q'uo\\te", 'd"q', "a\x00b", "k ", "K", "k", "", "\U0001f600", "x" * MAX_KEY_BYTES]
    requests = [
        ClaimRequest(key, None if i % 3 == 0 else f"fp'{i}\\", f"t{i}")
        for i, key in enumerate(odd + [f"plain-{i}" for i in range(40)])
    ]
    requests.append(ClaimRequest("plain-3", "other", "t-again"))  # repeated: the first wins
    before = _server_ms()
    claims = store.claim_many(
        "billing", requests, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
    )
    after = _server_ms()
    assert [c.status for c in claims] == [ClaimStatus.NEW] * (len(requests) - 1) + [
        ClaimStatus.EXISTING
    ]
    assert claims[-1].record == claims[len(odd) + 3].record
    for claim in claims:
        assert claim.record == store.get("billing", claim.record.key)
        assert before <= claim.now_ms == claim.record.created_ms <= after
        assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS
