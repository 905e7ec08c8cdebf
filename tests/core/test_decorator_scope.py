"""``@inbox.idempotent``: a key belongs to one function (its scope is part of the fingerprint
its records keep, whatever the inbox's fingerprint strategy), and a repeat's type (bare
containers rebuilt; a warning for an unannotated function whose result would come back as
another type). On real stores (PostgreSQL, Redis), sync and async (R1, R19, R20 step 6)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely._core.fingerprint import fingerprint
from tests.backends import BACKENDS, Backend, Scope

STRATEGIES = {
    "payload": oncely.Fingerprint.payload,
    "fields": lambda: oncely.Fingerprint.fields("order_id"),
    "none": oncely.Fingerprint.none,
}


@pytest.fixture(params=["postgres", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen = BACKENDS[str(request.param)]
    chosen.require()
    return chosen


def _inbox(backend: Backend, scope: Scope, strategy: str = "payload") -> oncely.Inbox:
    return oncely.Inbox(
        backend.make_sync(scope, None),
        consumer=f"deco-{scope.unique}",
        fingerprint=STRATEGIES[strategy](),
    )


def _async_inbox(backend: Backend, scope: Scope, strategy: str = "payload") -> oncely.AsyncInbox:
    return oncely.AsyncInbox(
        backend.make_async(scope, None),
        consumer=f"deco-{scope.unique}",
        fingerprint=STRATEGIES[strategy](),
    )


def _says_what_to_do(conflict: oncely.KeyConflict, name: str) -> None:
    text = str(conflict)
    assert f"{name} was not run" in text
    assert "by another function" in text and "other arguments" in text
    assert "give each function its own keys" in text
    assert "scope=" in text and "renamed or moved" in text
    assert conflict.handled.outcome is oncely.Outcome.KEY_CONFLICT


# ------------------------------------------------------------------ one key, one function


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_r20_another_function_with_the_same_key_conflicts_and_does_not_run(
    backend: Backend, scope: Scope, strategy: str
) -> None:
    # Before, send_receipt found charge's record (the same argument names and values, so the
    # same fingerprint; with Fingerprint.none() no fingerprint at all) and returned "charged
    # o-1" without running: a silent wrong answer.
    inbox = _inbox(backend, scope, strategy)
    ran: list[str] = []

    @inbox.idempotent(key=lambda order_id: order_id)
    def charge(order_id: str) -> str:
        ran.append("charge")
        return f"charged {order_id}"

    @inbox.idempotent(key=lambda order_id: order_id)
    def send_receipt(order_id: str) -> str:
        ran.append("send_receipt")
        return f"receipt for {order_id}"

    try:
        assert charge("o-1") == "charged o-1"
        assert charge("o-1") == "charged o-1"  # a repeat: the first result
        with pytest.raises(oncely.KeyConflict) as conflict:
            send_receipt("o-1")
        _says_what_to_do(conflict.value, "send_receipt")
        assert charge("o-1") == "charged o-1"  # the key is still charge's
        assert ran == ["charge"]
    finally:
        inbox.close()
        inbox.store.close()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
async def test_r20_async_another_function_with_the_same_key_conflicts_and_does_not_run(
    backend: Backend, scope: Scope, strategy: str
) -> None:
    inbox = _async_inbox(backend, scope, strategy)
    ran: list[str] = []

    @inbox.idempotent(key=lambda order_id: order_id)
    async def charge(order_id: str) -> str:
        ran.append("charge")
        return "charged"

    @inbox.idempotent(key=lambda oid: oid)
    async def notify(oid: str) -> str:  # other argument names: a conflict all the same
        ran.append("notify")
        return "notified"

    @inbox.idempotent(key=lambda order_id: order_id)
    async def ship(order_id: str) -> str:
        ran.append("ship")
        return "shipped"

    try:
        assert await charge("o-1") == "charged"
        assert await charge("o-1") == "charged"
        for other, name in ((ship, "ship"), (notify, "notify")):
            with pytest.raises(oncely.KeyConflict) as conflict:
                await other("o-1")
            _says_what_to_do(conflict.value, name)
        assert ran == ["charge"]
    finally:
        await inbox.aclose()
        await inbox.store.aclose()


def test_r20_the_same_function_with_other_arguments_still_conflicts(
    backend: Backend, scope: Scope
) -> None:
    inbox = _inbox(backend, scope)

    @inbox.idempotent(key=lambda order_id, amount: order_id)
    def refund(order_id: str, amount: int) -> int:
        return amount

    try:
        assert refund("o-1", 5) == 5
        assert refund("o-1", 5) == 5
        with pytest.raises(oncely.KeyConflict) as conflict:
            refund("o-1", 6)
        _says_what_to_do(conflict.value, "refund")
    finally:
        inbox.close()
        inbox.store.close()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_r1_scope_keeps_the_keys_of_a_renamed_function(
    backend: Backend, scope: Scope, strategy: str
) -> None:
    inbox = _inbox(backend, scope, strategy)
    ran: list[str] = []

    @inbox.idempotent(key=lambda order_id: order_id)
    def charge(order_id: str) -> str:
        ran.append("charge")
        return "charged"

    old_name = f"{charge.__module__}.{charge.__qualname__}"

    @inbox.idempotent(key=lambda order_id: order_id, scope=old_name)
    def take_payment(order_id: str) -> str:  # charge, renamed
        ran.append("take_payment")
        return "taken"

    @inbox.idempotent(key=lambda order_id: order_id, scope="billing.charge")
    def named(order_id: str) -> str:
        ran.append("named")
        return "named"

    try:
        assert charge("o-1") == "charged"
        assert take_payment("o-1") == "charged"  # charge's record: a repeat, not run
        with pytest.raises(oncely.KeyConflict, match=r"scope is 'billing\.charge'"):
            named("o-1")
        assert ran == ["charge"]
    finally:
        inbox.close()
        inbox.store.close()


async def test_r1_async_scope_keeps_the_keys_of_a_renamed_function(
    backend: Backend, scope: Scope
) -> None:
    inbox = _async_inbox(backend, scope, "fields")
    ran: list[str] = []

    @inbox.idempotent(key=lambda order_id: order_id, scope="billing.charge")
    async def charge(order_id: str) -> str:
        ran.append("charge")
        return "charged"

    @inbox.idempotent(key=lambda order_id: order_id, scope="billing.charge")
    async def take_payment(order_id: str) -> str:
        ran.append("take_payment")
        return "taken"

    try:
        assert await charge("o-1") == "charged"
        assert await take_payment("o-1") == "charged"
        assert ran == ["charge"]
    finally:
        await inbox.aclose()
        await inbox.store.aclose()


def test_r20_handle_keeps_the_plain_fingerprint_of_its_payload(
    backend: Backend, scope: Scope
) -> None:
    # Callers of handle (adapters, jobs, task integrations) are untouched: no scope, the
    # payload's own fingerprint, as records already stored have it.
    inbox = _inbox(backend, scope)
    try:
        inbox.handle("k", {"order_id": "o-1"}, lambda payload: "done")
        record = inbox.get("k")
        assert record is not None and record.fingerprint == fingerprint({"order_id": "o-1"})
    finally:
        inbox.close()
        inbox.store.close()


def test_a_blank_scope_is_refused(tmp_path: Path) -> None:
    inbox = oncely.Inbox(oncely.open(f"sqlite:///{tmp_path / 'i.db'}"), consumer="c")
    with pytest.raises(oncely.ConfigurationError, match="non-empty string"):
        inbox.idempotent(key=lambda order: order, scope=" ")
    inbox.close()
    inbox.store.close()


# ------------------------------------------------------------------ a repeat's type


@pytest.mark.parametrize(
    ("annotation", "value"),
    [(tuple, (1, "a")), (set, {1, 2}), (frozenset, frozenset({"x"}))],
)
def test_r1_a_bare_container_comes_back_as_itself(
    backend: Backend, scope: Scope, annotation: Any, value: Any
) -> None:
    # Before, a bare tuple, set or frozenset came back as the list it is stored as.
    inbox = _inbox(backend, scope)

    def make(order: str) -> Any:
        return value

    make.__annotations__["return"] = annotation  # -> tuple, -> set, -> frozenset
    made = inbox.idempotent(key=lambda order: order)(make)
    try:
        assert made("o-1") == value
        again = made("o-1")
        assert type(again) is annotation and again == value
    finally:
        inbox.close()
        inbox.store.close()


@dataclass
class Receipt:
    order: str


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "oncely" and r.levelno == logging.WARNING and "no return type" in r.message
    ]


def test_r1_an_unannotated_function_is_warned_about_once_at_its_first_lossy_result(
    backend: Backend, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    inbox = _inbox(backend, scope)
    results: dict[str, Any] = {"a": None, "b": {"n": 1}, "c": b"\x00\x01", "d": b"\x02"}

    @inbox.idempotent(key=lambda order: order)
    def blob(order: str):  # no return type: the point
        return results[order]

    @inbox.idempotent(key=lambda order: order)
    def receipt(order: str):
        return [Receipt(order)]

    @inbox.idempotent(key=lambda order: order)
    def typed(order: str) -> bytes:
        return b"\x00"

    try:
        blob("a")  # None and a dict of str come back as they were: nothing to say
        blob("b")
        assert _warnings(caplog) == []
        blob("c")
        assert blob("c") == "AAE="  # what the warning is about: base64 text
        blob("d")
        (warned,) = _warnings(caplog)  # once per function, not per call
        assert "blob" in warned and "bytes" in warned and "str (base64)" in warned
        assert "annotate its return type (-> bytes)" in warned and "returns=" in warned
        receipt("r")
        receipt("s")
        typed("t")
        assert len(_warnings(caplog)) == 2
        assert "the Receipt in its result as dict" in _warnings(caplog)[1]
    finally:
        inbox.close()
        inbox.store.close()


async def test_r1_async_an_unannotated_function_is_warned_about_once(
    backend: Backend, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    inbox = _async_inbox(backend, scope)

    @inbox.idempotent(key=lambda order: order)
    async def pair(order: str):
        return {1: (order, order)}

    @inbox.idempotent(key=lambda order: order, returns=None)
    async def stored(order: str):
        return (order,)  # returns=None: the stored form is what the caller asked for

    try:
        await pair("a")
        await pair("b")
        await stored("c")
        (warned,) = _warnings(caplog)
        assert "pair" in warned and "int keys" in warned and "dict[int, ...]" in warned
    finally:
        await inbox.aclose()
        await inbox.store.aclose()


# ------------------------------------------------------------------ what can be decorated


def test_r1_a_partial_and_a_callable_object_are_decorated_scoped_by_what_they_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``functools.partial`` or an object with ``__call__`` has no ``__qualname__``:
    decorating one raised AttributeError. Its scope is the function a partial wraps, the
    class of a callable object; the unannotated-result warning names it the same way."""
    import functools

    inbox = oncely.Inbox(oncely.open(f"sqlite:///{tmp_path / 'i.db'}"), consumer="c")
    runs: list[str] = []

    def charge(order: str, currency: str) -> str:
        runs.append(order)
        return f"{order} in {currency}"

    class Refund:
        def __call__(self, order: str) -> bytes:
            runs.append(f"refund {order}")
            return b"done"

    in_eur = inbox.idempotent(key=lambda order: order)(functools.partial(charge, currency="EUR"))
    refund = inbox.idempotent(key=lambda order: f"refund:{order}")(Refund())
    assert in_eur("o-1") == in_eur("o-1") == "o-1 in EUR"
    assert refund("o-1") == refund("o-1") == b"done"
    assert runs == ["o-1", "refund o-1"]
    with pytest.raises(oncely.KeyConflict) as raised:
        inbox.idempotent(key=lambda order: order)(Refund())("o-1")  # charge's key
    assert "Refund was not run" in str(raised.value)
    assert "scope is 'tests.core.test_decorator_scope." in str(raised.value)
    inbox.close()
    inbox.store.close()
