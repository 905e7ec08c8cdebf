"""Batch claims (R8) on PostgreSQL: answers equal the reference model's and the rows
written, and existing rows are read by primary key only.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import oncely
from oncely._core.records import ClaimRequest, Completion
from oncely._core.state import ClaimEvent, CompleteEvent, FailEvent
from oncely._core.table import RecordTable
from oncely.stores import ClaimStatus
from oncely.stores.postgres.dialect import PostgresDialect, text_array
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _TWO_PHASE, KEEP_MS, LEASE_MS, _sql


def _batches_match_the_model(store: Any, clock: oncely.FakeClock, seed: int) -> None:
    """Records in every state (live, stale, completed, failed, expired, absent), then batch
    claims with keys repeated, fingerprints that agree or not, takeover on and off: every
    answer, and then every record, equals the reference model's (the claims made one by one
    at one clock reading)."""
    rng = random.Random(seed)
    model = RecordTable()
    keys = [f"k{i}" for i in range(20)] + ['q"uo\\te', "{a,b}", "NULL", "", "\U0001f600"]
    number = iter(range(1_000_000))

    def event(key: str, lease: int, keep: int, takeover: bool) -> ClaimEvent:
        fp = rng.choice([None, "f", "g"])
        return ClaimEvent("c", key, fp, f"t{next(number)}", lease, keep, takeover)

    for _ in range(12):
        for key in rng.sample(keys, 8):
            ev = event(key, rng.choice([1_000, LEASE_MS]), rng.choice([2_000, KEEP_MS]), True)
            got = store.claim(
                "c", key, fingerprint=ev.fingerprint, token=ev.token, lease_ms=ev.lease_ms,
                keep_ms=ev.keep_ms, takeover=True,
            )  # fmt: skip
            assert got == model.claim(ev, clock.now_ms())
            if got.won and rng.random() < 0.5:
                keep = rng.choice([2_000, KEEP_MS])
                if rng.random() < 0.5:
                    done = CompleteEvent(ev.token, b"r", keep)
                    assert store.complete(
                        "c", key, token=ev.token, result=b"r", keep_ms=keep
                    ) == model.complete("c", key, done, clock.now_ms())
                else:
                    failed = FailEvent(ev.token, "e", keep)
                    assert store.fail(
                        "c", key, token=ev.token, error="e", keep_ms=keep
                    ) == model.fail("c", key, failed, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 500, 1_500, 2_500, LEASE_MS])))
        takeover = rng.random() < 0.7
        batch = [event(rng.choice(keys), LEASE_MS, KEEP_MS, takeover) for _ in range(25)]
        got_many = store.claim_many(
            "c", [ClaimRequest(e.key, e.fingerprint, e.token) for e in batch],
            lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=takeover,
        )  # fmt: skip
        assert got_many == model.claim_many(batch, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 700])))
    now = clock.now_ms()
    assert [store.get("c", k) for k in keys] == [model.get("c", k, now) for k in keys]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_r8_batch_claims_match_the_model(table: str, seed: int) -> None:
    clock = oncely.FakeClock()
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=2, clock=clock)
    try:
        _batches_match_the_model(store, clock, seed)
    finally:
        store.close()


def test_r8_a_batch_of_new_keys_answers_the_rows_it_wrote(store: PostgresStore) -> None:
    """New keys are not read back: the answers are built from what was sent and the server's
    clock reading, and must equal the rows, whatever the keys hold (quotes, backslashes,
    braces, commas, empty, NULL as text, 4-byte characters) and with or without fingerprints."""
    odd = ['q"uo\\te', "{a,b}", "NULL", "", " sp ", "\U0001f600", "a\\", '"', "k,1"]
    requests = [
        ClaimRequest(key, None if i % 3 == 0 else f'fp"{i}\\', f"t{i}")
        for i, key in enumerate(odd + [f"plain-{i}" for i in range(40)])
    ]
    requests.append(ClaimRequest("plain-3", "other", "t-again"))  # repeated: the first wins
    before = _server_ms()
    claims = store.claim_many("c", requests, **_TWO_PHASE)
    after = _server_ms()
    assert [c.status for c in claims] == [ClaimStatus.NEW] * (len(requests) - 1) + [
        ClaimStatus.EXISTING
    ]
    assert claims[-1].record == claims[len(odd) + 3].record
    for claim in claims:
        assert claim.record == store.get("c", claim.record.key)
        assert before <= claim.now_ms == claim.record.created_ms <= after
        assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS


def _server_ms() -> int:
    return int(_sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0])


@pytest.mark.parametrize("cache", ["auto", "force_generic_plan"])
def test_r8_a_batch_reads_existing_rows_by_primary_key_only(table: str, cache: str) -> None:
    """The batch statement's read of existing rows is a primary-key lookup per key, even on a
    table whose statistics say it is small (a fresh table, before autovacuum's ANALYZE): a
    join would be planned as a scan of every row of the consumer, whose cost grows with the
    table."""
    store = PostgresStore(POSTGRES_DSN, table=table)
    store.migrate()
    store.close()
    _sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    _sql(
        f"INSERT INTO {table} SELECT 'c', 'old-' || g, 'completed', NULL, 't' || g, 1, 0, 0, "
        f"0, 9000000000000, NULL, NULL FROM generate_series(1, 20000) g"
    )
    d = PostgresDialect("public", table)
    params = {
        "now": None,
        "consumer": "c",
        "keys": text_array([f"k{i}" for i in range(100)]),
        "fingerprints": text_array([None] * 100),
        "tokens": text_array([f"t-{i}" for i in range(100)]),
        "lease": LEASE_MS,
        "span": KEEP_MS,
    }
    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.execute(f"SET plan_cache_mode = {cache}".encode())
        plan = "\n".join(
            row[0] for row in conn.execute(b"EXPLAIN " + d.claim_many, params, prepare=True)
        )
        conn.rollback()
    scans = [line.strip() for line in plan.splitlines() if f" on {table}" in line]
    assert scans and all(s.startswith("->  Index Scan") or "Insert on" in s for s in scans), plan


def test_r10_complete_many_sends_large_results_in_several_statements(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The results of one complete_many statement are one array value, which PostgreSQL bounds
    at 1 GB: a batch whose results are together over the store's bound is completed in runs
    within it (each result whole), not refused as a whole after every handler ran."""
    import oncely.stores.postgres.sync_store as module

    monkeypatch.setattr(module, "_MANY_BYTES", 25)
    statements: list[int] = []
    one = module.PostgresStore._complete_many

    def counted(self: Any, consumer: str, completions: Any, keep_ms: int) -> Any:
        statements.append(len(completions))
        return one(self, consumer, completions, keep_ms)

    monkeypatch.setattr(module.PostgresStore, "_complete_many", counted)
    keys = [f"k{i}" for i in range(5)]
    claims = store.claim_many(
        "c", [ClaimRequest(k, None, f"t-{k}") for k in keys],
        lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False,
    )  # fmt: skip
    assert all(c.won for c in claims)
    results = [f"result-{k}!".encode() for k in keys]  # 10 bytes each
    done = store.complete_many(
        "c", [Completion(k, f"t-{k}", r) for k, r in zip(keys, results, strict=True)],
        keep_ms=KEEP_MS,
    )  # fmt: skip
    assert statements == [2, 2, 1]
    assert [d.result for d in done] == results  # type: ignore[union-attr]
    for k, r in zip(keys, results, strict=True):
        record = store.get("c", k)
        assert record is not None and record.result == r


def test_r10_the_result_room_is_half_of_postgresqls_1_gb(store: PostgresStore) -> None:
    room, why = store.result_room()
    assert (1 << 29) - 64 * 1024 < room < 1 << 29
    assert "1 GB" in why
