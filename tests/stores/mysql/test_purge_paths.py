"""The MariaDB purge's two paths (R13): the purge index, or a walk of the clustered index when a
large share of the table expired (cheaper there: measured at 10^6 rows with a 128 MB buffer
pool, 22,700 rows/s against 7,400). Each run chooses at its first batch; both must keep every
promise of the purge under concurrent claims, so the race test runs once on each, forced."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from oncely.stores.mysql import sync_store
from tests.backends import BACKENDS, Scope
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
