"""The reference model's state machine against the MariaDB / MySQL store."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import drop_tables, url
from tests.contract.test_model_stateful import Blocking, StoreMatchesModel


def _model_table() -> str:
    return f"oncely_h_{uuid.uuid4().hex[:12]}"


class _SyncMatchesModel(StoreMatchesModel):
    """The reference model's state machine on this store (its own table per example)."""

    factory = staticmethod(
        lambda _dir, clock: MySQLStore.from_url(url(_model_table()), clock=clock)
    )
    transactional = True

    def teardown(self) -> None:
        table = self.store.table
        try:
            super().teardown()
        finally:
            drop_tables(table)


class _AsyncMatchesModel(_SyncMatchesModel):
    factory = staticmethod(
        lambda _dir, clock: Blocking(AsyncMySQLStore.from_url(url(_model_table()), clock=clock))
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("machine", [_SyncMatchesModel, _AsyncMatchesModel], ids=["sync", "async"])
def test_r8_r10_the_store_matches_the_model(server: None, machine: type[StoreMatchesModel]) -> None:
    """Hypothesis drives this store and the state table side by side (claims, takeovers,
    fenced writes, transactional claims, purges, clock steps onto lease and retention edges)
    and compares every answer, as it does for the SQLite store."""
    run_state_machine_as_test(
        machine, settings=settings(max_examples=30, stateful_step_count=40, deadline=None)
    )
