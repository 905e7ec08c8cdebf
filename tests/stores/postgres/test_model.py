"""The contract suite's hypothesis state machine against the PostgreSQL store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import oncely
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.contract.test_model_stateful import Blocking, _machine
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _sql


@pytest.mark.parametrize(("flavour", "examples"), [("sync", 40), ("async", 15)])
def test_r8_r10_store_matches_the_model(flavour: str, examples: int) -> None:
    """The hypothesis state machine of the contract suite, against this store (a fresh table
    per example in a schema of its own): every answer equals the reference model's."""
    schema = f"oncely_m_{uuid.uuid4().hex[:8]}"

    def factory(_dir: Path, clock: oncely.FakeClock) -> object:
        name = f"m_{uuid.uuid4().hex[:12]}"
        if flavour == "sync":
            return PostgresStore(POSTGRES_DSN, schema=schema, table=name, pool_max=2, clock=clock)
        return Blocking(
            AsyncPostgresStore(POSTGRES_DSN, schema=schema, table=name, pool_max=2, clock=clock)
        )

    try:
        run_state_machine_as_test(
            _machine(factory, True),
            settings=settings(max_examples=examples, stateful_step_count=30, deadline=None),
        )
    finally:
        _sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
