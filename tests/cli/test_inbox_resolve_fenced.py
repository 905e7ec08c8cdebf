"""``oncely inbox resolve --retry`` and ``oncely inbox forget`` on every store delete a
settled record only while it is the record they read (R8, R10): between the read and the
delete it may expire, or be forgotten by another operator, and be claimed afresh by a
delivery whose worker is running the handler; that live claim is kept, and the command says
so and exits 1.

The interval between the command's read and its delete is a few statements long: to land in
it, the store the command opens is the real one, with the other party's writes done (on the
real server) right before the command's delete.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

import oncely
from oncely import Status
from tests.cli.conftest import StoreUrl
from tests.cli.helpers import run

LONG = 3_600_000


class _RaceBeforeDelete:
    """The store a command opens, with ``meanwhile`` run once right before it deletes the
    record it read (after every read it makes); every call goes to the real store."""

    def __init__(self, store: oncely.Store, meanwhile: Callable[[], None]) -> None:
        self._store = store
        self._meanwhile: Callable[[], None] | None = meanwhile

    def _race(self) -> None:
        if self._meanwhile is not None:
            self._meanwhile()
            self._meanwhile = None

    def forget(self, consumer: str, key: str) -> bool:
        self._race()
        return self._store.forget(consumer, key)

    def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        self._race()
        return self._store.forget_by_token(consumer, key, token=token)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _poison(made: oncely.Store, key: str) -> None:
    claim = made.claim("c", key, fingerprint=None, token="first", lease_ms=LONG, keep_ms=LONG,
                       takeover=False)  # fmt: skip
    assert claim.won
    made.fail("c", key, token="first", error="poison", keep_ms=LONG)


def _redelivered(made: oncely.Store, key: str) -> Callable[[], None]:
    def meanwhile() -> None:  # another operator forgets it; a delivery claims it afresh
        assert made.forget("c", key)
        claim = made.claim("c", key, fingerprint=None, token="redelivery", lease_ms=LONG,
                           keep_ms=LONG, takeover=False)  # fmt: skip
        assert claim.won

    return meanwhile


def _racing(monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], None]) -> None:
    real_open = oncely.open

    def racing_open(url: str, **kwargs: Any) -> Any:
        return _RaceBeforeDelete(real_open(url, **kwargs), meanwhile)

    monkeypatch.setattr(oncely, "open", racing_open)


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (
            ("resolve", "--retry"),
            ("not resolved: 'order-bad' changed while it was being resolved", "a live claim",
             "nothing was deleted"),
        ),
        (("forget", "--yes"), ("changed meanwhile",)),
    ],
    ids=["resolve-retry", "forget"],
)  # fmt: skip
def test_r10_a_delete_spares_a_live_owner_that_took_the_record_meanwhile(
    each_store: StoreUrl,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, str],
    says: tuple[str, ...],
) -> None:
    made, url, _ = each_store
    _poison(made, "order-bad")
    _racing(monkeypatch, _redelivered(made, "order-bad"))
    verb, flag = command
    result = run("inbox", verb, "--store", url, "--consumer", "c", "order-bad", flag)
    assert result.exit_code == 1, result.stdout
    for said in says:
        assert said in result.stderr
    kept = made.get("c", "order-bad")
    assert kept is not None and kept.token == "redelivery" and kept.status is Status.IN_PROGRESS
    # Still the worker's: it completes its claim.
    made.complete("c", "order-bad", token="redelivery", result=None, keep_ms=LONG)


def test_r10_resolve_retry_refuses_a_record_a_live_owner_holds(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    claim = made.claim("c", "running", fingerprint=None, token="worker", lease_ms=LONG,
                       keep_ms=LONG, takeover=False)  # fmt: skip
    assert claim.won
    result = run("inbox", "resolve", "--store", url, "--consumer", "c", "running", "--retry")
    assert result.exit_code == 1
    assert "held by a live claim" in result.stderr
    # Its lease's end as show prints it (milliseconds), not with microseconds.
    assert re.search(r"lease until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00\)", result.stderr)
    kept = made.get("c", "running")
    assert kept is not None and kept.token == "worker"
    # With nothing in its way, the poison message is deleted as asked.
    _poison(made, "poison")
    done = run("inbox", "resolve", "--store", url, "--consumer", "c", "poison", "--retry")
    assert done.exit_code == 0, done.stderr
    assert made.get("c", "poison") is None
