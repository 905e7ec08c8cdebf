"""Schema version 2 of the SQLite and MariaDB stores keeps tokens and fingerprints as bytes
(16 and 17 instead of 32 and 35 characters, R20: the inbox at production size), behind a
migration that keeps every record of version 1 working (R13).

A table of version 1 (revision 2), populated by an older oncely (every token and fingerprint
as text), is refused with the command to run and why older workers must stop first; after
``migrate`` each of its records is handled as before: a repeat is a duplicate with its stored
result, another payload a key conflict, a stale claim is taken over (by a claim and by an
explicit takeover of the token read), an expired record is claimed afresh, and a claim in
flight stays in flight. What the new oncely writes is kept in the compact form, and an oncely
that knows only version 1 refuses the migrated table instead of misreading it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import oncely
from oncely.stores import ClaimStatus
from oncely.stores._compact import pack_fingerprint, pack_token
from tests.backends import BACKENDS, Scope
from tests.contract.test_purge_migration import STORES

LONG = 3_600_000
COMPACT = ["mysql", "sqlite"]


@pytest.mark.parametrize("name", COMPACT)
def test_r13_r20_a_version_1_table_keeps_every_record_after_the_compact_migration(
    name: str, scope: Scope
) -> None:
    BACKENDS[name].require()
    open_store, raw, _ = STORES[name](scope)
    store = open_store(True)
    store.migrate()
    inbox = oncely.Inbox(store, consumer="c", retention=oncely.Retention(keep=timedelta(hours=1)))
    for i in range(5):
        assert inbox.handle(f"done-{i}", {"n": i}, lambda p: {"paid": p["n"]}).outcome.value == (
            "processed"
        )
    fp = oncely.fingerprint({"n": 1})
    token = "0123456789abcdef0123456789abcdef"
    for key in ("stale", "stale-explicit"):  # claims whose lease ran out
        store.claim("c", key, fingerprint=fp, token=token, lease_ms=1, keep_ms=LONG,
                    takeover=False)  # fmt: skip
    store.claim("c", "gone", fingerprint=fp, token=token, lease_ms=1, keep_ms=1,
                takeover=False)  # fmt: skip
    store.claim("c", "running", fingerprint=fp, token=token, lease_ms=LONG, keep_ms=LONG,
                takeover=False)  # fmt: skip
    store.close()
    raw.to_version_1()
    assert {unpacked for (unpacked,) in raw.run(f"SELECT token FROM {raw.t}", ())} >= {
        token if name == "sqlite" else token.encode()
    }  # text, as an older oncely wrote it

    store = open_store(False)
    with pytest.raises(oncely.SchemaOutdated, match="oncely migrate") as outdated:
        store.get("c", "done-0")
    assert "stop them first" in str(outdated.value)
    if name == "mysql":
        assert raw.purge_index() == ["purge_ms"]  # type: ignore[attr-defined]
    assert store.migrate() == 2
    if name == "mysql":  # each minute ordered by the claim's time: written at its end
        assert raw.purge_index() == ["purge_ms", "created_ms"]  # type: ignore[attr-defined]
    time.sleep(0.05)  # the 1 ms leases and the 1 ms retention have run out

    inbox = oncely.Inbox(store, consumer="c")
    for i in range(5):
        again = inbox.handle(f"done-{i}", {"n": i}, lambda p: pytest.fail("ran twice"))
        assert (again.outcome.value, again.value) == ("duplicate", {"paid": i})
    other = inbox.handle("done-2", {"n": 99}, lambda p: pytest.fail("ran a conflict"))
    assert other.outcome.value == "key_conflict"
    busy = inbox.handle("running", {"n": 1}, lambda p: pytest.fail("ran while in flight"))
    assert busy.outcome.value == "in_flight"

    new_token = "fedcba9876543210fedcba9876543210"
    taken = store.claim("c", "stale", fingerprint=fp, token=new_token, lease_ms=LONG,
                        keep_ms=LONG, takeover=True)  # fmt: skip
    assert (taken.status, taken.record.token, taken.record.attempt) == (
        ClaimStatus.TAKEN_OVER, new_token, 2,
    )  # fmt: skip
    current = store.get("c", "stale-explicit")
    assert current is not None and current.token == token and current.fingerprint == fp
    explicit = store.takeover("c", "stale-explicit", expected_token=current.token,
                              fingerprint=fp, token=new_token, lease_ms=LONG,
                              keep_ms=LONG)  # fmt: skip
    assert (explicit.status, explicit.record.token) == (ClaimStatus.TAKEN_OVER, new_token)
    fresh = store.claim("c", "gone", fingerprint=None, token=new_token, lease_ms=LONG,
                        keep_ms=LONG, takeover=False)  # fmt: skip
    assert (fresh.status, fresh.record.attempt) == (ClaimStatus.NEW, 1)
    done = store.complete("c", "stale", token=new_token, result=b"r", keep_ms=LONG)
    assert (done.status, done.token, done.fingerprint) == (
        oncely.Status.COMPLETED, new_token, fp,
    )  # fmt: skip

    stored = raw.run(
        f"SELECT token, fingerprint FROM {raw.t} WHERE {raw.key} IN (%s, %s)",
        ("stale", "stale-explicit"),
    )
    assert {(bytes(t), bytes(f)) for t, f in stored} == {
        (pack_token(new_token), pack_fingerprint(fp))
    }
    assert len(pack_token(new_token)) == 16 and len(pack_fingerprint(fp) or b"") == 17
    store.close()


@pytest.mark.parametrize("name", COMPACT)
def test_r13_an_oncely_that_knows_only_version_1_refuses_the_migrated_table(
    name: str, scope: Scope
) -> None:
    BACKENDS[name].require()
    open_store, _, _ = STORES[name](scope)
    store = open_store(True)
    store.migrate()
    store.close()
    older = open_store(False)
    older._SCHEMA_VERSION = 1  # type: ignore[attr-defined]  # what an older oncely supports
    with pytest.raises(oncely.SchemaTooNew, match="upgrade oncely"):
        older.get("c", "k")
    older.close()
