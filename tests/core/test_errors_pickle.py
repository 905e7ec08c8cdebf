"""Every exception oncely raises survives pickling, and so do the values it carries.

A worker of a ``ProcessPoolExecutor``, a ``multiprocessing`` pool or a Celery task sends its
exception to the parent as a pickle. An exception whose ``__init__`` takes other arguments than
its ``args`` (``OutcomeError(message, handled)``, ``LeaseLost(message, current)``) used to fail
to unpickle there: the pool broke, Celery fell back to the nearest base class that did.

The classes are found by walking ``OncelyError.__subclasses__()``, so a class added later is
tested without anyone listing it here; one whose constructor needs more than a message must be
given an example in ``EXAMPLES`` (the test says so).

Equality: :class:`~oncely.Handled` and :class:`~oncely.Record` are dataclasses and compare by
their fields, but an exception compares by identity, so an unpickled ``Handled.error`` (or an
unpickled exception) is never ``==`` to the original. :func:`assert_same` compares exceptions by
what a pickle can carry: type, ``args``, ``str`` and their own attributes, recursively.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import multiprocessing
import pickle
from collections.abc import Callable, Iterator

import pytest

import oncely
import oncely.brokers
import oncely.errors
import oncely.etl  # its exceptions walked whatever the tests run before (order-free)
import oncely.jobs
from oncely._core.outcomes import Handled, Outcome
from oncely._core.records import Record, Status
from oncely.brokers import UndecodableBody
from oncely.errors import (
    Escalated,
    InFlight,
    KeyConflict,
    LeaseLost,
    OncelyError,
    OutcomeError,
    Reject,
    Rejected,
    ResolveRefused,
    ResultUnavailable,
)

PROTOCOLS = list(range(pickle.HIGHEST_PROTOCOL + 1))

# Exception classes users can see outside ``oncely.errors``; each must also be an OncelyError
# (the walk below finds it only once its module is imported, hence the explicit list).
EXTRA_CLASSES: list[type[BaseException]] = [UndecodableBody]


def all_exception_classes() -> list[type[BaseException]]:
    """Every exception class oncely defines: the tree under OncelyError, walked recursively
    (test modules' own subclasses left out), plus the extra ones."""
    found: dict[type[BaseException], None] = {}
    stack: list[type[BaseException]] = [OncelyError, *EXTRA_CLASSES]
    while stack:
        cls = stack.pop()
        if cls in found or not cls.__module__.startswith("oncely"):
            continue
        found[cls] = None
        stack.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


# -- realistic values ---------------------------------------------------------------------------

RECORD = Record(
    consumer="billing",
    key="refund:o-1",
    status=Status.COMPLETED,
    fingerprint="v1:b48465408132d0bff24c5d5f94bfe758",
    token="136f3bbeaf9f92720000000000000000",
    attempt=2,
    created_ms=1_796_156_153_362,
    updated_ms=1_796_156_153_363,
    lease_until_ms=1_796_156_183_362,
    expires_ms=1_796_760_953_363,
    result=b'{"refund_id":"r-9"}',
    error=None,
)
IN_PROGRESS = dataclasses.replace(
    RECORD, status=Status.IN_PROGRESS, result=None, token="9f0e" * 8, attempt=3
)
FAILED_RECORD = dataclasses.replace(RECORD, status=Status.FAILED, result=None, error="poison")


def handled(outcome: Outcome, **fields: object) -> Handled[object]:
    base: dict[str, object] = {
        "consumer": "billing",
        "key": "refund:o-1",
        "record": RECORD,
        "attempt": 2,
        "duration_s": 0.0042,
        "correlation_id": "req-77",
    }
    base.update(fields)
    return Handled(outcome, **base)  # type: ignore[arg-type]


CONFLICT = handled(
    Outcome.KEY_CONFLICT,
    reason="key reused for different content: the completed record has fingerprint "
    "v1:b48465408132d0bff24c5d5f94bfe758, this message another",
)
IN_FLIGHT = handled(
    Outcome.IN_FLIGHT, reason="claimed by another worker until 12:00:30", record=IN_PROGRESS
)
ESCALATED = handled(
    Outcome.ESCALATED, reason="a lapsed claim was parked for a person", record=IN_PROGRESS
)
REJECTED = handled(Outcome.REJECTED, reason="poison", record=FAILED_RECORD)
NO_KEY = handled(Outcome.REJECTED, key=None, reason="no key: header 'id' missing", record=None)
LOST = LeaseLost(
    "complete: key 'refund:o-1' (consumer 'billing') is in_progress under another claim "
    "(attempt 3); nothing was changed",
    IN_PROGRESS,
)
FAILED_WITH_ERROR = handled(
    Outcome.FAILED,
    reason="reconciler raised LeaseLost",
    error=LOST,
    value={"partial": [1, 2, 3]},
    record=IN_PROGRESS,
)
FAILED_PLAIN = handled(Outcome.FAILED, reason="handler raised ValueError", error=ValueError("x"))
FAILED_NO_ERROR = handled(Outcome.FAILED, reason="the handler failed in another process")
PROCESSED = handled(Outcome.PROCESSED, value={"refund_id": "r-9", "amounts": (5, 6)})


def outcome_error(cls: type[OutcomeError], h: Handled[object]) -> OutcomeError:
    """The exception exactly as :meth:`Handled.unwrap` raises it."""
    with pytest.raises(cls) as info:
        h.unwrap()
    return info.value


# Classes whose constructor takes more than a message, with realistic instances (several where
# a field may be absent). Every other class is built as ``cls(message)``.
EXAMPLES: dict[type[BaseException], Callable[[], list[BaseException]]] = {
    oncely.etl.CheckpointMismatch: lambda: [
        oncely.etl.CheckpointMismatch("clicks", 100, 150, 200),  # past the mark
        oncely.etl.CheckpointMismatch("clicks", 100, 50, 200),  # straddles it
    ],
    LeaseLost: lambda: [
        LOST,
        LeaseLost("renew: no live record for key 'refund:o-1' (consumer 'billing')", None),
    ],
    ResolveRefused: lambda: [
        ResolveRefused("'refund:o-1' is held by a live claim", LOST.current),
        ResolveRefused("'refund:o-1' has no record: there is nothing to retry", None),
    ],
    Reject: lambda: [Reject("order o-1 has a negative amount")],
    OutcomeError: lambda: [outcome_error(OutcomeError, FAILED_NO_ERROR)],
    InFlight: lambda: [outcome_error(InFlight, IN_FLIGHT)],
    KeyConflict: lambda: [outcome_error(KeyConflict, CONFLICT)],
    Escalated: lambda: [outcome_error(Escalated, ESCALATED)],
    Rejected: lambda: [outcome_error(Rejected, REJECTED), outcome_error(Rejected, NO_KEY)],
    ResultUnavailable: lambda: [
        ResultUnavailable(
            "refund ran for 'refund:o-1' before, but its result is not there to return",
            handled(Outcome.DUPLICATE, reason="result not stored: 300000 bytes is over the limit"),
        )
    ],
}


def examples_of(cls: type[BaseException]) -> list[BaseException]:
    if cls in EXAMPLES:
        return EXAMPLES[cls]()
    message = f"{cls.__name__}: something went wrong with key 'refund:o-1'"
    try:
        exc = cls(message)
    except TypeError as error:  # pragma: no cover - only a new class gets here
        pytest.fail(
            f"{cls.__module__}.{cls.__qualname__}({message!r}) failed ({error}): its "
            "constructor takes other arguments; add realistic instances to EXAMPLES"
        )
    assert exc.args == (message,)
    assert vars(exc) == {}, f"{cls.__qualname__} sets attributes: add it to EXAMPLES"
    return [exc]


# -- comparison ---------------------------------------------------------------------------------


def assert_same(original: object, copied: object, where: str = "value") -> None:
    """``copied`` is ``original`` after a round trip: equal values, and exceptions (which
    compare by identity) of the same type with the same args, text and attributes."""
    assert type(copied) is type(original), where
    if isinstance(original, BaseException):
        assert isinstance(copied, BaseException)
        assert copied is not original, where
        assert copied.args == original.args, where
        assert str(copied) == str(original), where
        assert set(vars(copied)) == set(vars(original)), where
        for name, value in vars(original).items():
            assert_same(value, vars(copied)[name], f"{where}.{name}")
    elif isinstance(original, Handled):
        assert isinstance(copied, Handled)
        for f in dataclasses.fields(Handled):
            assert_same(getattr(original, f.name), getattr(copied, f.name), f"{where}.{f.name}")
        if original.error is None:
            assert copied == original, where
            assert hashes(copied) == hashes(original), where
        else:
            # Equal in everything but the identity of the exception.
            assert dataclasses.replace(copied, error=None) == dataclasses.replace(
                original, error=None
            ), where
    else:
        assert copied == original, where


def hashes(value: object) -> int | None:
    """The hash, or None for a value that holds something unhashable (a dict result)."""
    try:
        return hash(value)
    except TypeError:
        return None


def round_trip(value: object, protocol: int) -> object:
    return pickle.loads(pickle.dumps(value, protocol=protocol))


# -- the tests ----------------------------------------------------------------------------------


def test_the_walk_finds_every_public_exception() -> None:
    classes = set(all_exception_classes())
    public = {getattr(oncely.errors, name) for name in oncely.errors.__all__}
    assert public <= classes
    assert set(EXTRA_CLASSES) <= classes
    assert set(EXAMPLES) <= classes
    for name in oncely.__all__:  # and every exception exported from the top level
        value = getattr(oncely, name)
        if isinstance(value, type) and issubclass(value, Exception):
            if issubclass(value, Warning):  # KeyWarning: a warning category, never raised
                continue
            assert value in classes, name
    for name in oncely.brokers.__all__:
        value = getattr(oncely.brokers, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value in classes, name


def _cases() -> Iterator[object]:
    for cls in all_exception_classes():
        yield pytest.param(cls, id=f"{cls.__module__.removeprefix('oncely.')}.{cls.__qualname__}")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("cls", list(_cases()))
def test_every_exception_round_trips_through_pickle(
    cls: type[BaseException], protocol: int
) -> None:
    for exc in examples_of(cls):
        assert type(exc) is cls
        copied = round_trip(exc, protocol)
        assert_same(exc, copied, cls.__qualname__)
        assert isinstance(copied, cls)
        # Twice: the copy pickles like the original.
        assert_same(exc, round_trip(copied, protocol), cls.__qualname__)


@pytest.mark.parametrize("cls", list(_cases()))
def test_every_exception_copies_and_deep_copies(cls: type[BaseException]) -> None:
    for exc in examples_of(cls):
        assert_same(exc, copy.copy(exc), cls.__qualname__)
        assert_same(exc, copy.deepcopy(exc), cls.__qualname__)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_fields_survive_by_name(protocol: int) -> None:
    conflict = outcome_error(KeyConflict, CONFLICT)
    back = round_trip(conflict, protocol)
    assert isinstance(back, KeyConflict)
    assert back.handled == CONFLICT
    assert back.handled.outcome is Outcome.KEY_CONFLICT
    assert back.handled.record == RECORD

    lost = round_trip(LOST, protocol)
    assert isinstance(lost, LeaseLost)
    assert lost.current == IN_PROGRESS
    assert lost.args == LOST.args

    reject = round_trip(Reject("order o-1 has a negative amount"), protocol)
    assert isinstance(reject, Reject)
    assert reject.reason == "order o-1 has a negative amount"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_notes_and_extra_attributes_survive(protocol: int) -> None:
    exc = outcome_error(InFlight, IN_FLIGHT)
    exc.add_note("while refunding order o-1")
    exc.retry_after_s = 3.5  # type: ignore[attr-defined]
    back = round_trip(exc, protocol)
    assert isinstance(back, InFlight)
    assert back.__notes__ == ["while refunding order o-1"]
    assert back.retry_after_s == 3.5  # type: ignore[attr-defined]
    assert back.handled == IN_FLIGHT


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_cycle_through_the_attributes_pickles(protocol: int) -> None:
    # An OutcomeError whose Handled carries the error itself: the attributes are restored after
    # the exception exists, so the cycle comes back as a cycle.
    exc = OutcomeError("failed for key 'k'", FAILED_NO_ERROR)
    exc.handled = dataclasses.replace(FAILED_NO_ERROR, error=exc)
    back = round_trip(exc, protocol)
    assert isinstance(back, OutcomeError)
    assert back.handled.error is back
    assert dataclasses.replace(back.handled, error=None) == FAILED_NO_ERROR


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "value",
    [CONFLICT, IN_FLIGHT, ESCALATED, REJECTED, NO_KEY, PROCESSED, FAILED_NO_ERROR],
    ids=["conflict", "in_flight", "escalated", "rejected", "no_key", "processed", "failed"],
)
def test_handled_round_trips_and_compares_equal(value: Handled[object], protocol: int) -> None:
    back = round_trip(value, protocol)
    assert back == value
    assert hashes(back) == hashes(value)
    assert_same(value, back)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("value", [FAILED_WITH_ERROR, FAILED_PLAIN], ids=["lease_lost", "value"])
def test_handled_with_an_error_round_trips_all_but_the_identity(
    value: Handled[object], protocol: int
) -> None:
    back = round_trip(value, protocol)
    assert isinstance(back, Handled)
    assert_same(value, back)
    # An exception compares by identity, so the copy differs from the original in that only.
    assert back != value
    assert dataclasses.replace(back, error=None) == dataclasses.replace(value, error=None)
    assert type(back.error) is type(value.error)
    assert back.error is not None and value.error is not None
    assert back.error.args == value.error.args
    if isinstance(value.error, LeaseLost):
        assert isinstance(back.error, LeaseLost)
        assert back.error.current == value.error.current


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("value", [RECORD, IN_PROGRESS, FAILED_RECORD], ids=["c", "i", "f"])
def test_record_round_trips(value: Record, protocol: int) -> None:
    back = round_trip(value, protocol)
    assert back == value
    assert hash(back) == hash(value)
    assert isinstance(back, Record)
    assert back.status is value.status


def test_values_built_on_the_hot_path_pickle_like_the_others() -> None:
    inbox = oncely.Inbox(oncely.MemoryStore(), consumer="c")
    done = inbox.handle("m-1", {"id": "m-1"}, lambda payload: {"ok": True})
    again = inbox.handle("m-1", {"id": "m-1"}, lambda payload: {"ok": True})
    assert (done.outcome, again.outcome) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    for value in (done, again, done.record):
        for protocol in PROTOCOLS:
            assert round_trip(value, protocol) == value


# -- across processes ---------------------------------------------------------------------------


def conflict_in_this_process() -> None:
    """Raise the KeyConflict of README's "A function call" example, from a real inbox.

    Run in a pool worker: the memory store lives in the worker, which makes the conflict."""
    inbox = oncely.Inbox(oncely.MemoryStore(), consumer="c")

    @inbox.idempotent(key=lambda order_id, amount: f"refund:{order_id}")
    def refund(order_id: str, amount: int) -> dict[str, object]:
        return {"order_id": order_id, "refunded": amount}

    assert refund("o-1", 5) == {"order_id": "o-1", "refunded": 5}
    assert refund("o-1", 5) == {"order_id": "o-1", "refunded": 5}
    refund("o-1", 6)  # same key, different arguments: raises KeyConflict


def add(a: int, b: int) -> int:
    return a + b


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_key_conflict_raised_in_a_process_pool_worker_reaches_the_parent(method: str) -> None:
    if method not in multiprocessing.get_all_start_methods():  # pragma: no cover
        pytest.skip(f"no {method} start method here")
    with pytest.raises(KeyConflict) as local:
        conflict_in_this_process()
    expected = local.value.handled

    context = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        future = pool.submit(conflict_in_this_process)
        with pytest.raises(KeyConflict) as remote:
            future.result(timeout=60)
        exc = remote.value
        assert type(exc) is KeyConflict
        got = exc.handled
        assert isinstance(got, Handled)
        assert got.outcome == Outcome.KEY_CONFLICT
        assert got.key == expected.key == "refund:o-1"
        assert got.consumer == expected.consumer == "c"
        assert got.reason == expected.reason
        assert got.reason is not None and "different content" in got.reason
        assert got.error is None
        assert got.record is not None and expected.record is not None
        assert got.record.fingerprint == expected.record.fingerprint
        assert got.record.result == expected.record.result
        assert got.record.status is Status.COMPLETED
        assert str(exc) == str(local.value)
        # The record's token and times belong to the worker's store; the text does not.
        assert exc.args == local.value.args

        # The pool is not broken: it runs the next call, and raises the next conflict too.
        assert pool.submit(add, 2, 3).result(timeout=60) == 5
        with pytest.raises(KeyConflict):
            pool.submit(conflict_in_this_process).result(timeout=60)
        assert pool.submit(add, 4, 5).result(timeout=60) == 9
