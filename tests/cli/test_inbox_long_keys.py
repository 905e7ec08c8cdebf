"""``oncely inbox show/forget/resolve KEY`` find a record its consumer stored hashed
(``--hash-long-keys``: a key over ``--max-key-bytes`` kept as ``sha256:<hex>``) by the key
the message carries, on every store (R2: one logical message, one key, however it is stored).
Before, each said there was no record for it, so an operator holding the key from a message
or a log could not look at, forget or settle its record."""

from __future__ import annotations

import json

import pytest

import oncely
from oncely import Outcome, Status
from oncely.keys import hashed_key
from tests.cli.conftest import StoreUrl
from tests.cli.helpers import run

LONG_KEY = "order:" + "x" * 600  # over the default max_key_bytes of 512
HUGE_KEY = "y" * 5000  # over every consumer's limit: only ever stored hashed


def _hashing(made: oncely.Store) -> oncely.Inbox:
    return oncely.Inbox(made, consumer="c", limits=oncely.Limits(hash_long_keys=True))


def _poison(_payload: object) -> None:
    raise oncely.Reject("bad amount")


def test_r2_show_finds_a_hashed_record_by_its_original_key(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    for key in (LONG_KEY, HUGE_KEY):
        assert _hashing(made).handle(key, {"n": 1}, lambda p: p).outcome is Outcome.PROCESSED
        shown = run("inbox", "show", "--store", url, "--consumer", "c", key)
        assert shown.exit_code == 0, shown.stderr
        assert f"key          {hashed_key(key)} (stored hashed: the SHA-256 of the " in shown.stdout
        assert "status       completed" in shown.stdout
        as_json = run("inbox", "show", "--store", url, "--consumer", "c", key, "--json")
        found = json.loads(as_json.stdout)
        assert found["key"] == hashed_key(key) and found["key_hashed"] is True
        # The stored form (as `inbox list` prints it) still names it, as given.
        listed = run("inbox", "show", "--store", url, "--consumer", "c", hashed_key(key), "--json")
        assert json.loads(listed.stdout)["key_hashed"] is False
    # --as-given looks only at the key as given: there is none.
    given = run("inbox", "show", "--store", url, "--consumer", "c", LONG_KEY, "--as-given")
    assert given.exit_code == 1 and "no live record" in given.stderr


def test_r2_resolve_and_forget_a_hashed_record_by_its_original_key(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    assert _hashing(made).handle(LONG_KEY, {}, _poison).outcome is Outcome.REJECTED
    retried = run("inbox", "resolve", "--store", url, "--consumer", "c", LONG_KEY, "--retry")
    assert retried.exit_code == 0, retried.stderr
    assert f"key '{hashed_key(LONG_KEY)}' (the SHA-256 of the 606-byte key given)" in (
        retried.stdout
    )
    assert made.get("c", hashed_key(LONG_KEY)) is None
    assert _hashing(made).handle(HUGE_KEY, {}, lambda p: 1).outcome is Outcome.PROCESSED
    forgot = run("inbox", "forget", "--store", url, "--consumer", "c", HUGE_KEY, "--yes")
    assert forgot.exit_code == 0, forgot.stderr
    assert made.get("c", hashed_key(HUGE_KEY)) is None


def test_r2_resolve_create_of_a_long_key_asks_which_form(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    base = ("inbox", "resolve", "--store", url, "--consumer", "c", LONG_KEY, "--create",
            "--completed", '{"ok": true}')  # fmt: skip
    unsure = run(*base)
    assert unsure.exit_code == 2
    assert "--as-given or --hashed" in unsure.stderr
    assert made.get("c", LONG_KEY) is None and made.get("c", hashed_key(LONG_KEY)) is None
    done = run(*base, "--hashed")
    assert done.exit_code == 0, done.stderr
    # The message, delivered to a consumer that hashes long keys, is its duplicate.
    handled = _hashing(made).handle(LONG_KEY, {}, lambda p: pytest.fail("must not run"))
    assert handled.outcome is Outcome.DUPLICATE and handled.value == {"ok": True}
    record = made.get("c", hashed_key(LONG_KEY))
    assert record is not None and record.status is Status.COMPLETED
