"""The per-message fast paths keep every behaviour of the slow ones they replace.

* ``new_record`` / ``new_claim`` / ``new_handled`` / ``claim_event`` build frozen dataclasses
  (:class:`~oncely.Record`, :class:`~oncely.stores.Claim`, :class:`~oncely.Handled` and the state
  machine's ``ClaimEvent``) without their ``object.__setattr__`` per field: what they build
  must be indistinguishable from the constructor's object (type, equality, hash, repr,
  immutability, dataclass helpers, pickle).
* The state machine builds its new records with ``new_record``: each transition must give
  the record ``dataclasses.replace`` gave before.
* The fingerprint of a plain dict takes an inline path: its value must stay the stored one
  (R20: fingerprints are compared with those written by earlier versions).
* The transactional mode skips the observer when no log record and no hook would come of it:
  logs and hooks must still see every outcome when they are on (R16).
* The SQLite claim runs its first INSERT apart from the retry loop of a contested key: the
  loop's later rounds (a winner that vanished between the INSERT and the read) must still
  claim the key afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import multiprocessing
import pickle
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely import Outcome
from oncely._core.fast import frozen_builder
from oncely._core.fingerprint import canonical_json, fingerprint
from oncely._core.inbox_rules import new_token
from oncely._core.observe import Observer, key_for_logs
from oncely._core.outcomes import Handled, new_handled
from oncely._core.records import (
    Claim,
    ClaimStatus,
    Record,
    Status,
    new_claim,
    new_record,
)
from oncely._core.state import (
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    RenewEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_renew,
    claim_event,
)
from oncely.errors import UnfingerprintablePayload

RECORD_FIELDS: tuple[Any, ...] = (
    "billing",
    "order-1",
    Status.IN_PROGRESS,
    "v1:" + "ab" * 16,
    "tok-1",
    3,
    1_000,
    2_000,
    3_000,
    4_000,
    b'{"ok":true}',
    "a note",
)


def _same_object(built: object, reference: object) -> None:
    assert type(built) is type(reference)
    assert built == reference
    assert hash(built) == hash(reference)
    assert repr(built) == repr(reference)
    assert dataclasses.asdict(built) == dataclasses.asdict(reference)  # type: ignore[call-overload]
    assert pickle.loads(pickle.dumps(built)) == reference
    assert not hasattr(built, "__dict__")


def test_new_record_builds_the_same_record_as_the_constructor() -> None:
    built = new_record(*RECORD_FIELDS)
    _same_object(built, Record(*RECORD_FIELDS))
    # Each value lands in its own field (a layout that drifted would mix them up).
    assert [getattr(built, f.name) for f in dataclasses.fields(Record)] == list(RECORD_FIELDS)
    assert built.is_live(2_999) and built.is_stale(3_000) and built.is_expired(4_000)
    changed = dataclasses.replace(built, result=None)
    assert type(changed) is Record and changed.result is None
    assert changed == dataclasses.replace(Record(*RECORD_FIELDS), result=None)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Record)])
def test_new_record_is_as_immutable_as_a_record(field: str) -> None:
    built = new_record(*RECORD_FIELDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(built, field)
    with pytest.raises((AttributeError, TypeError)):
        built.extra = 1  # type: ignore[attr-defined]


def test_new_claim_builds_the_same_claim_as_the_constructor() -> None:
    record = new_record(*RECORD_FIELDS)
    for status in ClaimStatus:
        built = new_claim(status, record, 2_500)
        _same_object(built, Claim(status, record, 2_500))
        assert built.won is (status is not ClaimStatus.EXISTING)
        with pytest.raises(dataclasses.FrozenInstanceError):
            built.now_ms = 0  # type: ignore[misc]


def test_claim_event_builds_the_same_event_as_the_constructor() -> None:
    fields: tuple[Any, ...] = ("billing", "order-1", "v1:ab", "tok", 30_000, 60_000, True)
    _same_object(claim_event(*fields), ClaimEvent(*fields))  # the defaults
    full = (*fields, Status.COMPLETED, "a reason")
    built = claim_event(*full)
    _same_object(built, ClaimEvent(*full))
    assert [getattr(built, f.name) for f in dataclasses.fields(ClaimEvent)] == list(full)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.token = "other"  # type: ignore[misc]


def test_the_state_machine_writes_the_records_replace_would() -> None:
    """R9/R10 transitions, each against the record dataclasses.replace builds from the one
    before: insert, takeover of a stale claim, renew, complete and fail."""
    event = claim_event("billing", "order-1", "v1:ab", "t1", 1_000, 60_000, True)
    _state, claim = apply_claim(None, event, 10_000)
    inserted = claim.record
    assert inserted == Record(
        "billing", "order-1", Status.IN_PROGRESS, "v1:ab", "t1", 1, 10_000, 10_000, 11_000,
        70_000, None, None,
    )  # fmt: skip
    retry = claim_event("billing", "order-1", None, "t2", 1_000, 60_000, True)
    _state, taken = apply_claim(inserted, retry, 12_000)
    assert taken.status is ClaimStatus.TAKEN_OVER
    assert taken.record == dataclasses.replace(
        inserted, token="t2", attempt=2, updated_ms=12_000, lease_until_ms=13_000,
        expires_ms=72_000,
    )  # fmt: skip
    _state, renewed = apply_renew(taken.record, RenewEvent("t2", 2_000, 60_000), 12_500)
    assert renewed == dataclasses.replace(
        taken.record, updated_ms=12_500, lease_until_ms=14_500, expires_ms=72_500
    )
    assert isinstance(renewed, Record)
    _state, done = apply_complete(renewed, CompleteEvent("t2", b"r", 5_000, "n"), 13_000)
    assert done == dataclasses.replace(
        renewed, status=Status.COMPLETED, updated_ms=13_000, expires_ms=18_000, result=b"r",
        error="n",
    )  # fmt: skip
    _state, failed = apply_fail(renewed, FailEvent("t2", "poison", 5_000), 13_000)
    assert failed == dataclasses.replace(
        renewed, status=Status.FAILED, updated_ms=13_000, expires_ms=18_000, error="poison"
    )
    for record in (inserted, taken.record, renewed, done, failed):
        _same_object(record, Record(*(getattr(record, f.name) for f in dataclasses.fields(Record))))


def test_new_handled_builds_the_same_handled_as_the_constructor() -> None:
    record = new_record(*RECORD_FIELDS)
    fields: tuple[Any, ...] = (
        Outcome.PROCESSED,
        "billing",
        "order-1",
        {"charged": 5},
        None,
        None,
        record,
        3,
        0.25,
        "corr-1",
    )
    built: Handled[Any] = new_handled(*fields)
    reference: Handled[Any] = Handled(*fields)
    assert type(built) is Handled
    assert built == reference
    assert repr(built) == repr(reference)
    assert [getattr(built, f.name) for f in dataclasses.fields(Handled)] == list(fields)
    assert built.ok and built.action is oncely.Action.ACK and built.unwrap() == {"charged": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.value = None  # type: ignore[misc]
    failed: Handled[Any] = new_handled(
        Outcome.FAILED, "billing", "k", None, "boom", KeyError("x"), None, 1, 0.0, None
    )
    with pytest.raises(KeyError):
        failed.unwrap()


# ------------------------------------------------------------------------------ fingerprint


def _reference(payload: object) -> str:
    """The documented definition: "v1:" + blake2b-128 of the canonical JSON text in UTF-8."""
    text = canonical_json(payload).encode("utf-8", "surrogatepass")
    return "v1:" + hashlib.blake2b(text, digest_size=16).hexdigest()


def test_r20_a_realistic_payload_keeps_its_stored_fingerprint() -> None:
    # Computed by the implementation before the dict fast path existed: a stored fingerprint
    # compared with a new one must still match, or every redelivery becomes a key conflict.
    payload = {
        "order_id": "ord-00000042",
        "account": 43,
        "amount_cents": 1250,
        "currency": "EUR",
        "customer": {"id": "cus-00042", "email": "a.user@example.com", "tier": "gold"},
        "items": [
            {"sku": "SKU-1001", "qty": 2, "price": "4.00"},
            {"sku": "SKU-2002", "qty": 1, "price": "4.50"},
        ],
        "created_at": "2026-01-01T12:00:00Z",
        "note": None,
        "ratio": 0.25,
        "ok": True,
        "name": "Zo\u00eb \u2603",
    }
    assert fingerprint(payload) == "v1:6543d0ac0eea45ffd8c15f2d88ec66f4"
    assert fingerprint(payload) == _reference(payload)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), json_like, max_size=6))
def test_r20_the_dict_fast_path_hashes_the_canonical_text(payload: dict[str, Any]) -> None:
    assert fingerprint(payload) == _reference(payload)
    # A dict subclass takes the general path; both must agree.
    assert fingerprint(OrderedDict(payload)) == fingerprint(payload)


def test_the_dict_fast_path_maps_special_values_like_the_general_path() -> None:
    payload = {
        "at": datetime(2026, 1, 1, tzinfo=UTC),
        "amount": Decimal("4.50"),
        "raw": b"\x00\x01",
        "tags": {"b", "a"},
        "lone": "\ud800",
    }
    assert fingerprint(payload) == _reference(payload)
    assert fingerprint(payload) == fingerprint(OrderedDict(payload))


@pytest.mark.parametrize("bad", [{"x": object()}, {"x": 2**70 * 1.0j}])
def test_the_dict_fast_path_refuses_what_the_general_path_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(UnfingerprintablePayload, match=r"Fingerprint\.fields"):
        fingerprint(bad)
    with pytest.raises(UnfingerprintablePayload):
        fingerprint(OrderedDict(bad))


def test_a_circular_dict_is_refused_not_looped_on() -> None:
    payload: dict[str, Any] = {}
    payload["self"] = payload
    with pytest.raises(UnfingerprintablePayload):
        fingerprint(payload)


# ------------------------------------------------------------------------------ tokens


def _token_in_child(queue: Any) -> None:
    queue.put(new_token())


def test_r10_fencing_tokens_are_unique_fixed_width_and_redrawn_in_a_forked_child() -> None:
    tokens = [new_token() for _ in range(1000)]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) == 32 and int(t, 16) >= 0 and t == t.lower() for t in tokens)
    # One process: one random prefix, then the counter, zero-padded to 16 hex digits.
    assert {t[:16] for t in tokens} == {tokens[0][:16]}
    assert [int(t[16:], 16) for t in tokens] == list(
        range(int(tokens[0][16:], 16), int(tokens[0][16:], 16) + 1000)
    )
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_token_in_child, args=(queue,))
    child.start()
    theirs = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert theirs[:16] != tokens[0][:16]  # a new prefix: no token of the parent can recur


# ------------------------------------------------------------------------------ observer


@pytest.mark.parametrize("outcome", list(Outcome))
def test_r16_every_outcome_is_logged_at_its_level(
    outcome: Outcome, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("oncely.test-levels")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    seen: list[Handled[object]] = []
    handled: Handled[object] = Handled(outcome, "billing", "k", reason="why")
    plain: Handled[object] = Handled(outcome, "billing", "k")
    observer = Observer(hooks=[seen.append], logger=logger)
    observer.emit(handled)
    observer.emit(plain)
    noted, bare = [r for r in caplog.records if r.name == logger.name]
    assert bare.levelno == outcome.log_level
    # An acknowledged outcome with a reason (the result was not stored) needs a person: WARNING.
    noted_level = (
        logging.WARNING if outcome in (Outcome.PROCESSED, Outcome.DUPLICATE) else outcome.log_level
    )
    assert noted.levelno == noted_level
    assert getattr(noted, "oncely_outcome", None) == outcome.value
    assert seen == [handled, plain]


def test_r16_the_text_of_an_outcome_line_escapes_control_characters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A key, correlation id or reason holding a newline cannot forge a second log line;
    the structured fields keep the exact text."""
    logger = logging.getLogger("oncely.test-escapes")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    forged = "k\nERROR processed consumer=billing key=forged"
    Observer(logger=logger).emit(
        Handled(Outcome.REJECTED, "billing", forged, reason="r\r\n", correlation_id="c\x1b[31m")
    )
    (record,) = [r for r in caplog.records if r.name == logger.name]
    text = record.getMessage()
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert "key=k\\nERROR processed" in text and "correlation_id=c\\x1b[31m" in text
    assert getattr(record, "oncely_key", None) == forged


def _book(tx: sqlite3.Connection, payload: dict[str, int]) -> int:
    tx.execute("INSERT INTO ledger (amount) VALUES (?)", (payload["amount"],))
    return payload["amount"]


def _store(tmp_path: Path) -> oncely.SQLiteStore:
    with sqlite3.connect(tmp_path / "o.db") as setup:
        setup.execute("CREATE TABLE ledger (amount INTEGER NOT NULL)")
    return oncely.SQLiteStore(tmp_path / "o.db")


def test_r16_transactional_outcomes_reach_hooks_with_logging_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="oncely")
    seen: list[Handled[object]] = []
    store = _store(tmp_path)
    inbox = oncely.Inbox(store, consumer="ledger", hooks=[seen.append])
    first = inbox.handle_in_transaction("k", {"amount": 5}, _book)
    again = inbox.handle_in_transaction("k", {"amount": 5}, _book)
    assert [h.outcome for h in seen] == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert seen == [first, again]
    assert first.value == 5 and again.value == 5
    assert first.record is not None and first.record.result == b"5"
    assert not [r for r in caplog.records if r.name == "oncely"]
    store.close()


def test_r16_transactional_outcomes_are_logged_when_logging_is_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="oncely")
    store = _store(tmp_path)
    inbox = oncely.Inbox(store, consumer="ledger")
    handled = inbox.handle_in_transaction("k", {"amount": 5}, _book, correlation_id="c-1")
    assert handled.outcome is Outcome.PROCESSED
    records = [r for r in caplog.records if r.name == "oncely"]
    assert [getattr(r, "oncely_outcome", None) for r in records] == ["processed"]
    assert getattr(records[0], "oncely_correlation_id", None) == "c-1"
    store.close()


def test_r16_a_failing_hook_is_logged_with_the_messages_key_and_correlation_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook that raises changes nothing for the message; its line names the message (the
    key as the inbox shows keys, and the correlation id), so the failure can be traced."""

    def broken(handled: Handled[object]) -> None:
        raise RuntimeError("exporter down")

    caplog.set_level(logging.INFO, logger="oncely")
    store = _store(tmp_path)
    inbox = oncely.Inbox(store, consumer="ledger", hooks=[broken], log_keys="hash")
    handled = inbox.handle_in_transaction("card-4111", {"amount": 5}, _book, correlation_id="c-7")
    assert handled.outcome is Outcome.PROCESSED
    failed = [r for r in caplog.records if "hook" in r.getMessage()]
    # Under log_keys="hash" the record carries its traceback as text, keys hashed, rather
    # than the exception object (whose text could name the key).
    assert len(failed) == 1 and failed[0].exc_info is None
    assert "RuntimeError: exporter down" in (failed[0].exc_text or "")
    assert getattr(failed[0], "oncely_key", None) == key_for_logs("card-4111", "hash")
    assert getattr(failed[0], "oncely_correlation_id", None) == "c-7"
    assert "card-4111" not in caplog.text
    store.close()


def test_r7_nothing_listening_changes_nothing_but_the_work_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="oncely")
    store = _store(tmp_path)
    inbox = oncely.Inbox(store, consumer="ledger")
    handled = inbox.handle_in_transaction("k", {"amount": 7}, _book)
    assert handled.outcome is Outcome.PROCESSED and handled.value == 7 and handled.attempt == 1
    assert handled.record == store.get("ledger", "k")
    assert handled.duration_s > 0
    store.close()
    with sqlite3.connect(tmp_path / "o.db") as check:
        assert check.execute("SELECT amount FROM ledger").fetchall() == [(7,)]


# ------------------------------------------------------------------------------ SQLite claim


def test_r9_a_winner_that_vanishes_before_it_is_read_is_claimed_afresh(tmp_path: Path) -> None:
    """The contested-claim loop's second round: the INSERT found the key taken, then the
    winner released it (from another connection) before the claim read it back."""
    store = oncely.SQLiteStore(tmp_path / "o.db", pool_size=1)
    first = store.claim(
        "c", "k", fingerprint=None, token="t-1", lease_ms=60_000, keep_ms=120_000, takeover=False
    )
    assert first.status is ClaimStatus.NEW
    other = sqlite3.connect(tmp_path / "o.db", isolation_level=None)
    released: list[str] = []

    def release_before_the_read(sql: str) -> None:
        if sql.lstrip().upper().startswith("SELECT") and not released:
            released.append(sql)
            other.execute("DELETE FROM oncely_inbox WHERE consumer = 'c' AND key = 'k'")

    # The store's one connection (pool_size=1), traced while the second claim runs on it.
    conn = store._pool.acquire()
    store._pool.release(conn)
    conn.set_trace_callback(release_before_the_read)
    try:
        second = store.claim(
            "c", "k", fingerprint="v1:x", token="t-2", lease_ms=60_000, keep_ms=120_000,
            takeover=False,
        )  # fmt: skip
    finally:
        conn.set_trace_callback(None)
    assert released, "the claim never read the winner back"
    assert second.status is ClaimStatus.NEW
    assert (second.record.token, second.record.attempt) == ("t-2", 1)
    assert second.record.fingerprint == "v1:x"
    assert store.get("c", "k") == second.record
    other.close()
    store.close()


@pytest.mark.parametrize(
    ("builder", "cls"),
    [(new_record, Record), (new_claim, Claim), (new_handled, Handled), (claim_event, ClaimEvent)],
)
def test_each_builder_has_its_dataclass_s_signature(builder: object, cls: type) -> None:
    # The typed stubs mypy reads are written by hand: the runtime builder is derived from the
    # class, so a field added, moved or given a default shows here.
    built = inspect.signature(builder)  # type: ignore[arg-type]
    own = inspect.signature(cls)
    assert [(p.name, p.default) for p in built.parameters.values()] == [
        (p.name, p.default) for p in own.parameters.values()
    ]


def test_frozen_builder_refuses_what_it_cannot_build_the_same() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="slotted"):
        frozen_builder(NoSlots)
    with pytest.raises(TypeError, match="default factory"):
        frozen_builder(Factory)
    with pytest.raises(TypeError, match="slotted"):
        frozen_builder(int)
