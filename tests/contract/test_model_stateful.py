"""Every store behaves exactly like the reference model (R8, R9, R10, R13).

A hypothesis :class:`RuleBasedStateMachine` drives a real store and
:class:`oncely._core.table.RecordTable` (the state table of :mod:`oncely._core.state`, executed
in memory) with the same operations on one shared :class:`oncely.FakeClock`, and asserts that
every answer is equal: the :class:`~oncely.Claim` of each claim and takeover, the records that
complete, fail and renew return, :class:`~oncely.LeaseLost` raised by both with the same
``current`` record, release booleans, purge counts, and after every step each record (``get``)
and the ``stats``.

Keys, consumers and fingerprints come from small pools so that operations collide; clock steps
land on and around lease and retention boundaries. A disagreement is a bug in the store (or in
the model): hypothesis shrinks it to the shortest sequence of operations and prints it.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import oncely
from oncely import FakeClock, LeaseLost
from oncely._core.records import Status
from oncely._core.state import (
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
)
from oncely._core.table import RecordTable

CONSUMERS = ("billing", "shipping")
KEYS = ("order-1", "order-2", "order-3")
FINGERPRINTS = (None, "v1:aaaa", "v1:bbbb")
LEASES = (1_000, 5_000)
KEEPS = (3_000, 60_000)  # 3s keep under a 5s lease: a record must still outlive its lease
# Clock steps: the lease and keep values above and their neighbours, short steps that leave a
# lapsed lease unexpired (the takeover window), and long jumps past every retention.
STEPS = st.sampled_from(
    [0, 1, 999, 1_000, 1_001, 2_999, 3_000, 3_001, 4_999, 5_000, 5_001, 59_999, 60_000, 60_001]
) | st.integers(min_value=0, max_value=6_000)
LONG_STEPS = st.integers(min_value=6_000, max_value=120_000)
RESULTS = st.sampled_from([None, b"", b'{"ok":true}', b"\x00\xff"])
NOTES = st.sampled_from([None, "completed by reconciler"])
ERRORS = st.sampled_from(["poison message", "boom"])
BOGUS = "tok-never-issued"

# The SQLite store gets the largest budget: it is the one that could disagree. The memory store
# executes the model itself (a sanity check of the harness); the async SQLite twin shares the SQL
# and differs in its hand-written I/O layer, and each of its calls goes through an event loop.
SETTINGS = {
    "memory": settings(max_examples=60, stateful_step_count=40, deadline=None),
    "sqlite": settings(max_examples=200, stateful_step_count=50, deadline=None),
    "async-sqlite": settings(max_examples=60, stateful_step_count=40, deadline=None),
}


class _Rollback(Exception):
    """Raised inside a transaction to roll it back."""


class Issued(NamedTuple):
    """A token some claim carried, and the record it was for."""

    consumer: str
    key: str
    token: str


consumers = st.sampled_from(CONSUMERS)
keys = st.sampled_from(KEYS)
fingerprints = st.sampled_from(FINGERPRINTS)


class Answer(NamedTuple):
    """What one call gave back, in a form that compares across store and model."""

    value: object
    lost: bool = False
    message: str | None = None


def _answer(call: Callable[[], object]) -> Answer:
    try:
        return Answer(call())
    except LeaseLost as exc:
        return Answer(exc.current, lost=True, message=str(exc))


StoreFactory = Callable[[Path, FakeClock], Any]


class Blocking:
    """An async store driven call by call on a private event loop, so the same machine (and
    the same model) checks the async twin, whose I/O layer is written by hand."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._runner = asyncio.Runner()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self._runner.run(attr(*args, **kwargs))

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        block = self._store.transaction()
        tx = self._runner.run(block.__aenter__())
        try:
            yield tx
        except BaseException as exc:
            if not self._runner.run(block.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._runner.run(block.__aexit__(None, None, None))

    def close(self) -> None:
        try:
            self._runner.run(self._store.aclose())
        finally:
            self._runner.close()


class StoreMatchesModel(RuleBasedStateMachine):
    """One example: a fresh store on a fresh temporary directory, the model, one clock."""

    factory: StoreFactory
    transactional: bool

    tokens = Bundle("tokens")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.model = RecordTable()
        self.directory = Path(tempfile.mkdtemp(prefix="oncely-model-"))
        self.store = type(self).factory(self.directory, self.clock)
        self.issued = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _token(self) -> str:
        self.issued += 1
        return f"tok-{self.issued}"

    def _same(
        self, op: str, store_call: Callable[[], object], model_call: Callable[[], object]
    ) -> None:
        got = _answer(store_call)
        expected = _answer(model_call)
        assert got == expected, f"{op}: store answered {got}, model {expected}"

    # ------------------------------------------------------------------ claims

    @rule(
        target=tokens,
        consumer=consumers,
        key=keys,
        fingerprint=fingerprints,
        takeover=st.booleans(),
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def claim(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        return self._claim(consumer, key, fingerprint, takeover, lease_ms, keep_ms)

    def _claim(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        token = self._token()
        event = ClaimEvent(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        now = self.clock.now_ms()
        self._same(
            "claim",
            lambda: self.store.claim(
                consumer,
                key,
                fingerprint=fingerprint,
                token=token,
                lease_ms=lease_ms,
                keep_ms=keep_ms,
                takeover=takeover,
            ),
            lambda: self.model.claim(event, now),
        )
        return Issued(consumer, key, token)

    def _in_progress(self) -> list[tuple[str, str]]:
        now = self.clock.now_ms()
        return sorted(
            ident
            for ident, record in self.model.records.items()
            if not record.is_expired(now) and record.status is Status.IN_PROGRESS
        )

    def _lapse(self, data: st.DataObject) -> tuple[str, str]:
        """An in-progress record whose lease has lapsed: a stale one, or a live one with the
        clock moved exactly to its lease's end (the boundary: ``lease_until == now`` is stale)."""
        ident = data.draw(st.sampled_from(self._in_progress()), label="in-progress record")
        record = self.model.records[ident]
        if record.is_live(self.clock.now_ms()):
            self.clock.set(record.lease_until_ms)
        return ident

    def _fingerprint_for(self, ident: tuple[str, str], relation: str) -> str | None:
        """A fingerprint that agrees with the record's (``same``, ``none``) or conflicts."""
        stored = self.model.records[ident].fingerprint
        if relation == "same":
            return stored
        if relation == "none":
            return None
        return FINGERPRINTS[2] if stored == FINGERPRINTS[1] else FINGERPRINTS[1]

    relations = st.sampled_from(["same", "none", "other"])

    @precondition(lambda self: bool(self._in_progress()))
    @rule(
        target=tokens,
        data=st.data(),
        relation=relations,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def claim_a_stale_record(
        self, data: st.DataObject, relation: str, lease_ms: int, keep_ms: int
    ) -> Issued:
        """A redelivery finds a lapsed lease and takes it over (R10), unless its content
        conflicts; aimed on purpose, since random claims rarely land in the window between a
        lease's end and the record's."""
        ident = self._lapse(data)
        fingerprint = self._fingerprint_for(ident, relation)
        return self._claim(*ident, fingerprint, True, lease_ms, keep_ms)

    @precondition(lambda self: bool(self._in_progress()))
    @rule(
        target=tokens,
        data=st.data(),
        right_token=st.booleans(),
        relation=relations,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def takeover_a_stale_record(
        self,
        data: st.DataObject,
        right_token: bool,
        relation: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        """A reconciler decided to retry the lapsed claim it looked at (R10), or one that was
        already taken over since (its token is outdated)."""
        ident = self._lapse(data)
        seen = self.model.records[ident].token if right_token else BOGUS
        fingerprint = self._fingerprint_for(ident, relation)
        return self._takeover(*ident, seen, fingerprint, lease_ms, keep_ms)

    @rule(
        target=tokens,
        expected=tokens,
        known=st.sampled_from(["current", "current", "issued", "bogus"]),
        fingerprint=fingerprints,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def takeover(
        self,
        expected: Issued,
        known: str,
        fingerprint: str | None,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        """A reconciler's takeover, expecting the token it saw on the record: the current one,
        one issued earlier for that record (maybe outdated), or one nobody issued."""
        consumer, key = expected.consumer, expected.key
        expected_token = {
            "current": self._current_token(consumer, key) or expected.token,
            "issued": expected.token,
            "bogus": BOGUS,
        }[known]
        return self._takeover(consumer, key, expected_token, fingerprint, lease_ms, keep_ms)

    def _takeover(
        self,
        consumer: str,
        key: str,
        expected_token: str,
        fingerprint: str | None,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        token = self._token()
        event = TakeoverEvent(
            ClaimEvent(consumer, key, fingerprint, token, lease_ms, keep_ms, True), expected_token
        )
        now = self.clock.now_ms()
        self._same(
            "takeover",
            lambda: self.store.takeover(
                consumer,
                key,
                expected_token=expected_token,
                fingerprint=fingerprint,
                token=token,
                lease_ms=lease_ms,
                keep_ms=keep_ms,
            ),
            lambda: self.model.takeover(event, now),
        )
        return Issued(consumer, key, token)

    @precondition(lambda self: self.transactional)
    @rule(
        target=tokens,
        consumer=consumers,
        key=keys,
        fingerprint=fingerprints,
        takeover=st.booleans(),
        keep_ms=st.sampled_from(KEEPS),
        initial=st.sampled_from([Status.COMPLETED, Status.FAILED]),
        result=RESULTS,
        commit=st.booleans(),
    )
    def claim_in_transaction(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        keep_ms: int,
        initial: Status,
        result: bytes | None,
        commit: bool,
    ) -> Issued:
        """Transactional mode (R7): the marker is inserted settled, with the result set in the
        same transaction; a rolled-back transaction leaves the store as it was."""
        store: Any = self.store  # a transactional store (see the precondition)
        token = self._token()
        error = "poison message" if initial is Status.FAILED else None
        event = ClaimEvent(consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error)
        now = self.clock.now_ms()
        ident = (consumer, key)
        # The answer the model would give, without writing it yet: the transaction may roll back.
        _, expected = apply_claim(self.model.records.get(ident), event, now)
        try:
            with store.transaction() as tx:
                got = store.claim_in(
                    tx,
                    consumer,
                    key,
                    fingerprint=fingerprint,
                    token=token,
                    keep_ms=keep_ms,
                    takeover=takeover,
                    initial=initial,
                    error=error,
                )
                assert got == expected, f"claim_in: store answered {got}, model {expected}"
                if got.won:
                    store.set_result_in(tx, consumer, key, token=token, result=result)
                if not commit:
                    raise _Rollback
        except _Rollback:
            assert not commit
        if commit:
            self.model.claim(event, now)
            if expected.won:
                self.model.records[ident] = replace(self.model.records[ident], result=result)
        return Issued(consumer, key, token)

    # ------------------------------------------------------------------ fenced writes

    # How a fenced write picks its token: the one a claim was issued for that record ("own"),
    # the record's current owner's ("current": the right token, whoever holds it now), an
    # issued token aimed at another record of the pool ("elsewhere"), or one nobody issued.
    aims = st.sampled_from(["own", "current", "current", "elsewhere", "bogus"])
    other_records = st.tuples(consumers, keys)

    def _current_token(self, consumer: str, key: str) -> str | None:
        # The token the record carries, even when it has expired and awaits a purge: the right
        # token on a record that no longer counts is a case of its own.
        record = self.model.records.get((consumer, key))
        return None if record is None else record.token

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
