"""The purge rests between batches (R13): each batch is followed by a pause of ``pause``
times the batch's own time, so a consumer sharing the database finds it idle between
batches; ``pause=0`` purges without rest, and a pause that is not a number from 0 to 100 is
refused before anything is deleted.

The rest is observed from inside: each batch's start and end are recorded around the store's
own batch, and the gap before the next batch must be at least ``pause`` times the batch (a
sleep never returns early). Nothing here asserts how fast anything is.
"""

from __future__ import annotations

import time
from datetime import timedelta
from itertools import pairwise
from typing import Any

import pytest

import oncely
import oncely.stores.sync_sql as sync_sql
from tests.backends import BACKENDS, Scope

SQL = sorted(n for n in ("mysql", "postgres", "sqlite") if n in BACKENDS)


def _expired(store: Any, n: int) -> None:
    for i in range(n):
        store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                    keep_ms=60_000, takeover=False)  # fmt: skip
        store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
    time.sleep(0.01)


def _timed_batches(store: Any) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    inner = store._purge_batch

    def batch(*args: Any) -> Any:
        began = time.monotonic()
        try:
            return inner(*args)
        finally:
            spans.append((began, time.monotonic()))

    store._purge_batch = batch
    return spans


@pytest.mark.parametrize("name", SQL)
@pytest.mark.parametrize("pause", [0.0, 3.0])
def test_r13_the_purge_rests_pause_times_each_batch(name: str, pause: float, scope: Scope) -> None:
    backend = BACKENDS[name]
    backend.require()
    store = backend.make_sync(scope, None)
    store.migrate()
    _expired(store, 40)
    spans = _timed_batches(store)
    assert store.purge_expired(batch_size=10, pause=pause) == 40
    assert len(spans) >= 4  # four full batches, then one that finds nothing
    for (began, ended), (after, _) in pairwise(spans):
        assert after - ended >= pause * (ended - began)
    assert store.get("c", "k0") is None
    store.close()


@pytest.mark.parametrize("pause", [-0.5, 101, float("nan"), float("inf"), True, "1"])
def test_a_pause_out_of_range_is_refused_before_a_purge(pause: Any, scope: Scope) -> None:
    backend = BACKENDS["sqlite"]
    store = backend.make_sync(scope, None)
    store.migrate()
    _expired(store, 3)
    with pytest.raises(oncely.ConfigurationError, match="pause"):
        store.purge_expired(pause=pause)
    with pytest.raises(oncely.ConfigurationError, match="pause"):
        oncely.PurgeService(store, every=timedelta(minutes=1), pause=pause)
    assert store.stats().expired == 3
    store.close()


def test_the_purge_service_hands_its_pause_to_the_store(scope: Scope) -> None:
    store = BACKENDS["sqlite"].make_sync(scope, None)
    store.migrate()
    _expired(store, 25)
    spans = _timed_batches(store)
    service = oncely.PurgeService(store, every=timedelta(minutes=1), batch_size=10, pause=2.0)
    assert service.run_once().deleted == 25
    for (began, ended), (after, _) in pairwise(spans):
        assert after - ended >= 2.0 * (ended - began)
    store.close()


def test_a_slow_on_batch_does_not_lengthen_the_rest(
    monkeypatch: pytest.MonkeyPatch, scope: Scope
) -> None:
    """The rest is pause x the batch's own time; a progress callback that takes long (a
    display, a report over the network) is not counted as the batch's work."""
    store = BACKENDS["sqlite"].make_sync(scope, None)
    store.migrate()
    _expired(store, 30)
    spans = _timed_batches(store)
    rests: list[float] = []
    monkeypatch.setattr(sync_sql, "sleep", rests.append)
    store.purge_expired(batch_size=10, pause=1.0, on_batch=lambda _s, _g: time.sleep(0.5))
    assert len(rests) == 3  # after each full batch
    for rest, (began, ended) in zip(rests, spans, strict=False):
        assert rest < 0.5
        assert rest >= ended - began
    store.close()
