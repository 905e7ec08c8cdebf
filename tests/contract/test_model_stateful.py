"""Every store behaves exactly like the reference model (R8, R9, R10, R13).

A hypothesis :class:`RuleBasedStateMachine` drives a real store and
:class:`oncely._core.table.RecordTable` (the state table of :mod:`oncely._core.state`, executed
in memory) with the same operations on one shared :class:`oncely.FakeClock`, and asserts that
every answer is equal: the :class:`~oncely.stores.Claim` of each claim and takeover, the records
that complete, fail and renew return, :class:`~oncely.LeaseLost` raised by both with the same
``current`` record, release booleans, purge counts, and after every step each record (``get``)
and the ``stats``.

Keys, consumers and fingerprints come from small pools so that operations collide; clock steps
land on and around lease and retention boundaries. A disagreement is a bug in the store (or in
the model): hypothesis shrinks it to the shortest sequence of operations and prints it.

The machine is built in layers: the pools, the answers and the base (a store, the model, one
clock) in model_helpers.py, the claim rules in model_claims.py, and here the fenced writes, the
reads and upkeep, the clock steps, the checks after every step and the stores it runs against.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import oncely
from oncely._core.state import CompleteEvent, FailEvent, ReleaseEvent, RenewEvent
from tests.contract.model_claims import ClaimRules
from tests.contract.model_helpers import (
    BOGUS,
    CONSUMERS,
    ERRORS,
    KEEPS,
    KEYS,
    LEASES,
    LONG_STEPS,
    NOTES,
    RESULTS,
    STEPS,
    Blocking,
    Issued,
    StoreFactory,
    consumers,
    keys,
    tokens,
)

# The SQLite store gets the largest budget: it is the one that could disagree. The memory store
# executes the model itself (a sanity check of the harness); the async SQLite twin shares the SQL
# and differs in its hand-written I/O layer, and each of its calls goes through an event loop.
SETTINGS = {
    "memory": settings(max_examples=60, stateful_step_count=40, deadline=None),
    "sqlite": settings(max_examples=200, stateful_step_count=50, deadline=None),
    "async-sqlite": settings(max_examples=60, stateful_step_count=40, deadline=None),
}


class StoreMatchesModel(ClaimRules):
    """The whole machine: the claim rules of :class:`ClaimRules`, and below the rules that
    write with a token, read, purge and move the clock, and the checks after every step."""

    # ------------------------------------------------------------------ fenced writes

    # How a fenced write picks its token: the one a claim was issued for that record ("own"),
    # the record's current owner's ("current": the right token, whoever holds it now), an
    # issued token aimed at another record of the pool ("elsewhere"), or one nobody issued.
    aims = st.sampled_from(["own", "current", "current", "elsewhere", "bogus"])
    other_records = st.tuples(consumers, keys)

    def _aim(self, issued: Issued, aim: str, elsewhere: tuple[str, str]) -> Issued:
        if aim == "elsewhere":
            return Issued(*elsewhere, issued.token)
        if aim == "bogus":
            return issued._replace(token=BOGUS)
        if aim == "current":
            current = self._current_token(issued.consumer, issued.key)
            return issued if current is None else issued._replace(token=current)
        return issued

    @rule(
        result=RESULTS,
        note=NOTES,
        keep_ms=st.sampled_from(KEEPS),
        issued=tokens,
        aim=aims,
        elsewhere=other_records,
    )
    def complete(
        self,
        issued: Issued,
        aim: str,
        elsewhere: tuple[str, str],
        result: bytes | None,
        note: str | None,
        keep_ms: int,
    ) -> None:
        c, k, t = self._aim(issued, aim, elsewhere)
        now = self.clock.now_ms()
        self._same(
            "complete",
            lambda: self.store.complete(c, k, token=t, result=result, keep_ms=keep_ms, note=note),
            lambda: self.model.complete(c, k, CompleteEvent(t, result, keep_ms, note), now),
        )

    @rule(
        error=ERRORS,
        keep_ms=st.sampled_from(KEEPS),
        issued=tokens,
        aim=aims,
        elsewhere=other_records,
    )
    def fail(
        self,
        issued: Issued,
        aim: str,
        elsewhere: tuple[str, str],
        error: str,
        keep_ms: int,
    ) -> None:
        c, k, t = self._aim(issued, aim, elsewhere)
        now = self.clock.now_ms()
        self._same(
            "fail",
            lambda: self.store.fail(c, k, token=t, error=error, keep_ms=keep_ms),
            lambda: self.model.fail(c, k, FailEvent(t, error, keep_ms), now),
        )

    @rule(
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
        issued=tokens,
        aim=aims,
        elsewhere=other_records,
    )
    def renew(
        self,
        issued: Issued,
        aim: str,
        elsewhere: tuple[str, str],
        lease_ms: int,
        keep_ms: int,
    ) -> None:
        c, k, t = self._aim(issued, aim, elsewhere)
        now = self.clock.now_ms()
        self._same(
            "renew",
            lambda: self.store.renew(c, k, token=t, lease_ms=lease_ms, keep_ms=keep_ms),
            lambda: self.model.renew(c, k, RenewEvent(t, lease_ms, keep_ms), now),
        )

    @rule(issued=tokens, aim=aims, elsewhere=other_records)
    def release(self, issued: Issued, aim: str, elsewhere: tuple[str, str]) -> None:
        c, k, t = self._aim(issued, aim, elsewhere)
        now = self.clock.now_ms()
        self._same(
            "release",
            lambda: self.store.release(c, k, token=t),
            lambda: self.model.release(c, k, ReleaseEvent(t), now),
        )

    # ------------------------------------------------------------------ reads and upkeep

    @rule(consumer=consumers, key=keys)
    def get(self, consumer: str, key: str) -> None:
        now = self.clock.now_ms()
        self._same(
            "get",
            lambda: self.store.get(consumer, key),
            lambda: self.model.get(consumer, key, now),
        )

    @rule(batch_size=st.sampled_from([1, 2, 1000]))
    def purge_expired(self, batch_size: int) -> None:
        now = self.clock.now_ms()
        self._same(
            "purge_expired",
            lambda: self.store.purge_expired(batch_size=batch_size),
            lambda: self.model.purge_expired(now, None),
        )

    @precondition(lambda self: bool(self.model.records))
    @rule(data=st.data(), batch_size=st.sampled_from([1, 1000]))
    def purge_at_an_expiry(self, data: st.DataObject, batch_size: int) -> None:
        """A sweep that runs the very millisecond a record expires (``expires == now``)."""
        self.advance_to_an_expiry(data, 0)
        self.purge_expired(batch_size)

    @rule(step=STEPS)
    def advance(self, step: int) -> None:
        self.clock.set(self.clock.now_ms() + step)

    @rule(step=LONG_STEPS)
    def advance_far(self, step: int) -> None:
        self.clock.set(self.clock.now_ms() + step)

    def _live_claims(self) -> list[tuple[str, str]]:
        now = self.clock.now_ms()
        return sorted(
            ident
            for ident, record in self.model.records.items()
            if not record.is_expired(now) and record.is_live(now)
        )

    @precondition(lambda self: bool(self._live_claims()))
    @rule(data=st.data(), delta=st.sampled_from([0, 0, -1, 1]))
    def advance_to_a_lease_end(self, data: st.DataObject, delta: int) -> None:
        """Land exactly on (or one millisecond either side of) the end of a live lease."""
        ident = data.draw(st.sampled_from(self._live_claims()), label="live claim")
        mark = self.model.records[ident].lease_until_ms + delta
        if mark > self.clock.now_ms():
            self.clock.set(mark)

    @precondition(lambda self: bool(self.model.records))
    @rule(data=st.data(), delta=st.sampled_from([0, 0, -1, 1]))
    def advance_to_an_expiry(self, data: st.DataObject, delta: int) -> None:
        """Land exactly on (or one millisecond either side of) the end of a record's retention."""
        ident = data.draw(st.sampled_from(sorted(self.model.records)), label="record")
        mark = self.model.records[ident].expires_ms + delta
        if mark > self.clock.now_ms():
            self.clock.set(mark)

    # ------------------------------------------------------------------ after every step

    @invariant()
    def every_record_agrees(self) -> None:
        now = self.clock.now_ms()
        for consumer in CONSUMERS:
            for key in KEYS:
                got = self.store.get(consumer, key)
                expected = self.model.get(consumer, key, now)
                assert got == expected, f"get({consumer!r}, {key!r}): store {got}, model {expected}"

    @invariant()
    def stats_agree(self) -> None:
        got = self.store.stats()
        expected = self.model.stats(self.clock.now_ms())
        assert got == expected, f"stats: store {got}, model {expected}"


def _machine(factory: StoreFactory, transactional: bool) -> type[StoreMatchesModel]:
    return type(
        "StoreMatchesModel",
        (StoreMatchesModel,),
        {"factory": staticmethod(factory), "transactional": transactional},
    )


MACHINES: dict[str, type[StoreMatchesModel]] = {
    "memory": _machine(lambda _dir, clock: oncely.MemoryStore(clock=clock), False),
    "sqlite": _machine(lambda d, clock: oncely.SQLiteStore(d / "oncely.db", clock=clock), True),
    "async-sqlite": _machine(
        lambda d, clock: Blocking(oncely.AsyncSQLiteStore(d / "oncely.db", clock=clock)), True
    ),
}


@pytest.mark.parametrize("store", sorted(MACHINES))
def test_r8_r10_store_matches_the_model(store: str) -> None:
    run_state_machine_as_test(MACHINES[store], settings=SETTINGS[store])
