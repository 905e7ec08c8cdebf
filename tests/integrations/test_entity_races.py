"""The business entity as the dedup marker under concurrent creators (R21), on real SQLite,
PostgreSQL, MariaDB: the second creator waits for the first, then never errs; racing creators
make exactly one row per key.

Each test makes tables of its own with unique names and drops them afterwards. PostgreSQL and
MariaDB tests skip without the server (fail under ONCELY_REQUIRE_SERVICES=1). The ``db`` and
``adb`` fixtures are in ``conftest.py``, the shared helpers in ``entity_helpers.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from decimal import Decimal

import pytest
import sqlalchemy as sa

from oncely.integrations.entity import EntityOutcome, EntityResult
from tests.integrations.entity_helpers import (
    CREATED,
    DUPLICATE,
    KEY_CONFLICT,
    Db,
    _by_fields,
    _waits_on_lock,
)


# --- R21: concurrent creators ------------------------------------------------------------
def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize(("amount", "expected"), [("12.50", DUPLICATE), ("77.00", KEY_CONFLICT)])
def test_r21_second_creator_waits_for_the_first_then_never_errs(
    db: Db, amount: str, expected: EntityOutcome
) -> None:
    first_committing = threading.Event()
    seen: dict[str, object] = {}

    def second() -> None:
        try:
            with db.engine.begin() as conn:
                # A read first: on MariaDB's REPEATABLE READ it fixes the snapshot before the
                # winner commits, so only a locking read can then see the winner's row.
                conn.execute(sa.select(db.customers)).all()
                seen["result"] = _by_fields(conn, db, amount=Decimal(amount))
                seen["after_first_commit"] = first_committing.is_set()
        except BaseException as exc:  # reported below
            seen["error"] = exc

    thread = threading.Thread(target=second)
    try:
        with db.engine.begin() as conn:
            assert _by_fields(conn, db).outcome is CREATED
            thread.start()
            _until(lambda: _waits_on_lock(db) or not thread.is_alive(), "the second to wait")
            first_committing.set()
    finally:  # on a failure too: the second finishes once the first has ended
        if thread.ident is not None:
            thread.join(30)
    assert "error" not in seen, seen.get("error")
    result = seen["result"]
    assert isinstance(result, EntityResult)
    assert result.outcome is expected
    assert seen["after_first_commit"] is True  # it waited on the unique index
    assert db.count(db.orders) == 1


def test_r21_racing_creators_make_exactly_one_row_per_key(db: Db) -> None:
    keys = [f"o-{i}" for i in range(5)]
    workers = 4
    barrier = threading.Barrier(workers)
    outcomes: dict[str, list[EntityOutcome]] = {key: [] for key in keys}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(offset: int) -> None:
        try:
            barrier.wait(10)
            for key in keys[offset:] + keys[:offset]:
                with db.engine.begin() as conn:
                    outcome = _by_fields(conn, db, key).outcome
                with lock:
                    outcomes[key].append(outcome)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i % len(keys),)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    for key in keys:
        assert sorted(outcomes[key]) == sorted([CREATED] + [DUPLICATE] * (workers - 1)), key
    assert db.count(db.orders) == len(keys)
