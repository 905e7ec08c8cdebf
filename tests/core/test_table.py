"""The reference model :class:`oncely._core.table.RecordTable` beyond single transitions:
purge, stats, scan, forget and the :class:`LeaseLost` it raises. The hypothesis state-machine
test (tests/contract/test_model_stateful.py) holds every store to this model."""

from __future__ import annotations

import pytest

from oncely._core.records import ClaimStatus, Status, StoreStats
from oncely._core.state import ClaimEvent, CompleteEvent, FailEvent, ReleaseEvent, RenewEvent
from oncely._core.table import RecordTable
from oncely.errors import LeaseLost

NOW = 1_000_000


def claim(
    table: RecordTable, consumer: str, key: str, *, keep: int = 10_000, now: int = NOW
) -> str:
    token = f"{consumer}/{key}/{now}"
    table.claim(ClaimEvent(consumer, key, None, token, 1_000, keep, False), now)
    return token


def test_r5_records_are_scoped_by_consumer() -> None:
    table = RecordTable()
    claim(table, "billing", "k")
    c = table.claim(ClaimEvent("shipping", "k", None, "t2", 1_000, 10_000, False), NOW)
    assert c.status is ClaimStatus.NEW, "another consumer's record never blocks this one"


def test_lease_lost_carries_the_current_record_and_says_so() -> None:
    table = RecordTable()
    claim(table, "c", "k")
    current = table.get("c", "k", NOW)
    with pytest.raises(LeaseLost, match="under another claim") as info:
        table.complete("c", "k", CompleteEvent("wrong", None, 10_000), NOW)
    assert info.value.current == current
    with pytest.raises(LeaseLost, match="no live record") as missing:
        table.renew("c", "nothing", RenewEvent("t", 1_000, 10_000), NOW)
    assert missing.value.current is None
    assert table.get("c", "k", NOW) == current, "a lost write changes nothing"


def test_release_deletes_and_reports() -> None:
    table = RecordTable()
    token = claim(table, "c", "k")
    assert table.release("c", "k", ReleaseEvent(token), NOW) is True
    assert table.get("c", "k", NOW) is None
    assert table.release("c", "k", ReleaseEvent(token), NOW) is False


def test_r13_expired_records_are_invisible_counted_and_purged() -> None:
    table = RecordTable()
    for i in range(5):
        claim(table, "c", f"k{i}", keep=1_000 * (i + 1))
    later = NOW + 2_500  # k0 (1s... lease 1s) and k1 (2s) expired
    assert table.get("c", "k0", later) is None
    assert table.get("c", "k2", later) is not None
    assert table.stats(later) == StoreStats(counts={"c": {Status.IN_PROGRESS: 3}}, expired=2)
    assert table.purge_expired(later, limit=1) == 1
    assert table.stats(later).expired == 1
    assert table.purge_expired(later, limit=None) == 1
    assert table.purge_expired(later, limit=None) == 0
    assert len(table.records) == 3


def test_stats_by_consumer_and_status() -> None:
    table = RecordTable()
    t1 = claim(table, "a", "k1")
    t2 = claim(table, "a", "k2")
    claim(table, "b", "k1")
    table.complete("a", "k1", CompleteEvent(t1, b"r", 10_000), NOW)
    table.fail("a", "k2", FailEvent(t2, "poison", 10_000), NOW)
    stats = table.stats(NOW)
    assert stats.counts == {
        "a": {Status.COMPLETED: 1, Status.FAILED: 1},
        "b": {Status.IN_PROGRESS: 1},
    }
    assert stats.total == 3
    assert stats.expired == 0


def test_scan_in_key_order_with_filters_and_paging() -> None:
    table = RecordTable()
    for consumer, key in [("b", "2"), ("a", "2"), ("a", "1"), ("b", "1")]:
        claim(table, consumer, key)
    t = claim(table, "a", "3")
    table.complete("a", "3", CompleteEvent(t, None, 10_000), NOW)
    idents = [(r.consumer, r.key) for r in table.scan(NOW, None, None, None, 100)]
    assert idents == [("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"), ("b", "2")]
    page = table.scan(NOW, None, None, ("a", "2"), 2)
    assert [(r.consumer, r.key) for r in page] == [("a", "3"), ("b", "1")]
    assert [r.key for r in table.scan(NOW, "b", None, None, 100)] == ["1", "2"]
    assert [r.key for r in table.scan(NOW, None, Status.COMPLETED, None, 100)] == ["3"]


def test_forget_removes_whatever_the_state() -> None:
    table = RecordTable()
    claim(table, "c", "k")
    assert table.forget("c", "k") is True
    assert table.forget("c", "k") is False
