"""The MariaDB purge's two paths (R13): the purge index, or a walk of the clustered index when a
large share of the table expired (cheaper there: measured at 10^6 rows with a 128 MB buffer
pool, 22,700 rows/s against 7,400). Each run chooses at its first batch; both must keep every
promise of the purge under concurrent claims, so the race test runs once on each, forced."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from oncely.stores.mysql import sync_store
from oncely.stores.sync_purging import PurgeService
from tests.backends import BACKENDS, Scope
from tests.backends.mysql import url
from tests.contract.test_purge_races import (
    test_r13_purges_racing_claims_delete_only_expired_records as race,
)


@pytest.mark.parametrize("path", ["sweep", "index"])
def test_r13_both_purge_paths_delete_only_expired_records(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    backend = BACKENDS["mysql"]
    backend.require()
    chosen: list[str] = []
    choose = sync_store.MySQLStore._purge_path

    def spy(self: sync_store.MySQLStore, conn: sync_store.Connection) -> str:
        found = choose(self, conn)
        chosen.append(found)
        return found

    monkeypatch.setattr(sync_store.MySQLStore, "_purge_path", spy)
    monkeypatch.setattr(sync_store, "SWEEP_FROM_ROWS", 0)
    share = 0.0 if path == "sweep" else 2.0  # any expired row / never
    monkeypatch.setattr(sync_store, "SWEEP_SHARE_COLD", share)
    monkeypatch.setattr(sync_store, "SWEEP_SHARE_WARM", share)
    scope = Scope(tmp_path=tmp_path, unique=uuid.uuid4().hex[:12])
    try:
        race(backend, scope)
    finally:
        for finalizer in reversed(scope.finalizers):
            finalizer()
    assert chosen and path in chosen
    assert set(chosen) <= {path, "index"}  # a run with nothing that ended takes the index


def test_r13_the_purge_lead_takes_no_connection_of_a_one_connection_pool(table: str) -> None:
    """The lead's GET_LOCK is held on a connection of its own, outside the pool, and that
    connection is closed when the lead ends (an unlock that failed included: the server lets
    go of a session's named locks as it ends): with ``pool_size=1`` the run's batches and the
    claims meanwhile still get the pool's connection, and the lead is free afterwards."""
    store = sync_store.MySQLStore.from_url(url(table, pool_size=1))
    other = sync_store.MySQLStore.from_url(url(table))
    try:
        store.migrate()
        for i in range(20):
            store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                        keep_ms=60_000, takeover=False)  # fmt: skip
            store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
        with store.purge_leader() as leads:  # type: ignore[attr-defined]
            assert leads
            assert store.purge_expired(batch_size=7, pause=0) == 20
            assert store.claim("c", "meanwhile", fingerprint=None, token="m", lease_ms=60_000,
                               keep_ms=60_000, takeover=False).won  # fmt: skip
        assert PurgeService(other, every=timedelta(minutes=1)).run_once().leader
    finally:
        store.close()
        other.close()
