"""A purge deletes what expired and nothing else, while consumers claim (R12, R13).

On every store, real threads: two purges run at once, in small batches, while two claimers
re-claim expired keys, claim new ones, and complete them; records expire during the run. A
purge must never delete an unexpired record (completed, in progress or failed), nor one a
claimer has just re-claimed; each expired record is deleted once at most (the two purges'
counts add up); and when everything has settled, nothing expired is left.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import oncely
from oncely.stores import ClaimStatus
from tests.backends import Backend, Scope

LONG = 3_600_000  # an hour: never expires during the test
SOON = 400  # expires while the claimers and purges run
GONE = 1  # already expired when the race starts
PER_KIND = 40


def _claim(store: oncely.Store, key: str, token: str, keep_ms: int = LONG) -> Any:
    return store.claim(
        "c", key, fingerprint="f", token=token, lease_ms=min(keep_ms, 60_000), keep_ms=keep_ms,
        takeover=False,
    )  # fmt: skip


def _done(store: oncely.Store, key: str, token: str, keep_ms: int) -> None:
    _claim(store, key, token)
    store.complete("c", key, token=token, result=b"r", keep_ms=keep_ms)


def test_r13_purges_racing_claims_delete_only_expired_records(
    backend: Backend, scope: Scope
) -> None:
    store = backend.make_sync(scope, None)
    store.migrate()
    kept: dict[str, str] = {}  # key -> the token that must still hold it at the end
    for i in range(PER_KIND):
        _done(store, f"done-{i}", f"d{i}", LONG)
        kept[f"done-{i}"] = f"d{i}"
        _claim(store, f"running-{i}", f"r{i}")
        kept[f"running-{i}"] = f"r{i}"
        _claim(store, f"failed-{i}", f"f{i}")
        store.fail("c", f"failed-{i}", token=f"f{i}", error="boom", keep_ms=LONG)
        kept[f"failed-{i}"] = f"f{i}"
        _done(store, f"old-{i}", f"o{i}", GONE)
        _done(store, f"soon-{i}", f"s{i}", SOON)
    time.sleep(0.05)  # every "old" record has expired

    deleted = [0, 0]
    reclaimed: dict[str, str] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def purge(slot: int) -> None:
        try:
            while not stop.is_set():
                deleted[slot] += store.purge_expired(batch_size=7)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def claimer(name: str, keys: list[str]) -> None:
        try:
            for n, key in enumerate(keys):
                token = f"{name}-{n}"
                claim = _claim(store, key, token)
                if claim.status is ClaimStatus.NEW:
                    store.complete("c", key, token=token, result=b"again", keep_ms=LONG)
                    reclaimed[key] = token
                time.sleep(0.002)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    old = [f"old-{i}" for i in range(PER_KIND)]
    soon = [f"soon-{i}" for i in range(PER_KIND)]
    fresh = [f"new-{i}" for i in range(PER_KIND)]
    threads = [
        threading.Thread(target=purge, args=(0,)),
        threading.Thread(target=purge, args=(1,)),
        # The first half of each list is re-claimed while the purges run; "soon" keys expire
        # part-way through, so some are re-claimed before their purge and some after.
        threading.Thread(target=claimer, args=("a", old[::2] + soon[::2] + fresh[::2])),
        threading.Thread(target=claimer, args=("b", fresh[1::2] + soon[1::4] + old[1::4])),
    ]
    for t in threads:
        t.start()
    time.sleep(SOON / 1000 + 0.3)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    time.sleep(SOON / 1000)  # every "soon" record not re-claimed has expired
    deleted.append(store.purge_expired())

    for key, token in {**kept, **reclaimed}.items():
        record = store.get("c", key)
        assert record is not None, f"{key} was purged while it was live"
        assert record.token == token, f"{key}: {record.token} is not {token}"
    expired = {*old, *soon} - set(reclaimed)
    assert all(store.get("c", key) is None for key in expired)
    if backend.name.startswith("redis"):
        assert sum(deleted) == 0  # on its own clock, Redis deletes each record at its expiry
    else:
        # Each expired record was deleted once at most, by one purge or the other (a
        # re-claimed key may have been purged first), and none are left.
        assert len(expired) <= sum(deleted) <= len(old) + len(soon), (deleted, len(expired))
    assert store.stats().expired == 0
    assert store.purge_expired() == 0
    store.close()
