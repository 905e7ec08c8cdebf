"""An in-memory record table that executes the state machine: the reference model.

Pure (time is passed in, no locking). The memory store wraps it with a lock and a clock; the
hypothesis state-machine test runs it beside a real store and compares every answer.
"""

from __future__ import annotations

from oncely._core.records import Claim, Record, Status, StoreStats
from oncely._core.state import (
    DELETE,
    UNCHANGED,
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    Lost,
    NewState,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_forget,
    apply_release,
    apply_renew,
    apply_takeover,
)
from oncely.errors import LeaseLost

__all__ = ["RecordTable", "lease_lost", "unfenced"]


def lease_lost(op: str, consumer: str, key: str, lost: Lost) -> LeaseLost:
    """The :class:`LeaseLost` for a fenced ``op`` that did not apply."""
    current = lost.current
    if current is None:
        text = f"{op}: no live record for key {key!r} (consumer {consumer!r})"
    else:
        text = (
            f"{op}: key {key!r} (consumer {consumer!r}) is {current.status} under another "
            f"claim (attempt {current.attempt}); nothing was changed"
        )
    return LeaseLost(text, current)


def unfenced(
    op: str, consumer: str, key: str, token: str, done: Status | None, current: Record | None
) -> Record:
    """The answer to a fenced ``op`` by ``token`` whose write matched no row (stores that run
    the fence in SQL), given the ``current`` live record: that record when the same write
    landed before (same token, status ``done``: a retry is idempotent), else raise
    :class:`LeaseLost`."""
    if current is not None and current.token == token and current.status is done:
        return current
    raise lease_lost(op, consumer, key, Lost(current))


class RecordTable:
    """Records by ``(consumer, key)``, changed only through the state machine."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], Record] = {}

    def _write(self, ident: tuple[str, str], new: NewState) -> None:
        if new is UNCHANGED:
            return
        if new is DELETE:
            del self.records[ident]
            return
        assert isinstance(new, Record)
        self.records[ident] = new

    def claim(self, ev: ClaimEvent, now: int) -> Claim:
        ident = (ev.consumer, ev.key)
        new, reply = apply_claim(self.records.get(ident), ev, now)
        self._write(ident, new)
        return reply

    def claim_many(self, events: list[ClaimEvent], now: int) -> list[Claim]:
        """Each claim in order, at one clock reading."""
        return [self.claim(ev, now) for ev in events]

    def takeover(self, ev: TakeoverEvent, now: int) -> Claim:
        ident = (ev.claim.consumer, ev.claim.key)
        new, reply = apply_takeover(self.records.get(ident), ev, now)
        self._write(ident, new)
        return reply

    def complete(self, consumer: str, key: str, ev: CompleteEvent, now: int) -> Record:
        new, reply = apply_complete(self.records.get((consumer, key)), ev, now)
        if isinstance(reply, Lost):
            raise lease_lost("complete", consumer, key, reply)
        self._write((consumer, key), new)
        return reply

    def fail(self, consumer: str, key: str, ev: FailEvent, now: int) -> Record:
        new, reply = apply_fail(self.records.get((consumer, key)), ev, now)
        if isinstance(reply, Lost):
            raise lease_lost("fail", consumer, key, reply)
        self._write((consumer, key), new)
        return reply

    def renew(self, consumer: str, key: str, ev: RenewEvent, now: int) -> Record:
        new, reply = apply_renew(self.records.get((consumer, key)), ev, now)
        if isinstance(reply, Lost):
            raise lease_lost("renew", consumer, key, reply)
        self._write((consumer, key), new)
        return reply

    def release(self, consumer: str, key: str, ev: ReleaseEvent, now: int) -> bool:
        new, reply = apply_release(self.records.get((consumer, key)), ev, now)
        if isinstance(reply, Lost):
            raise lease_lost("release", consumer, key, reply)
        self._write((consumer, key), new)
        return reply

    def forget_by_token(self, consumer: str, key: str, ev: ReleaseEvent, now: int) -> bool:
        new, reply = apply_forget(self.records.get((consumer, key)), ev, now)
        if isinstance(reply, Lost):
            raise lease_lost("forget", consumer, key, reply)
        self._write((consumer, key), new)
        return reply

    def get(self, consumer: str, key: str, now: int) -> Record | None:
        record = self.records.get((consumer, key))
        if record is None or record.expires_ms <= now:
            return None
        return record

    def purge_expired(self, now: int, limit: int | None) -> int:
        expired = [i for i, r in self.records.items() if r.expires_ms <= now]
        if limit is not None:
            expired = expired[:limit]
        for ident in expired:
            del self.records[ident]
        return len(expired)

    def stats(self, now: int) -> StoreStats:
        counts: dict[str, dict[Status, int]] = {}
        expired = 0
        for (consumer, _key), record in self.records.items():
            if record.expires_ms <= now:
                expired += 1
                continue
            by_status = counts.setdefault(consumer, {})
            by_status[record.status] = by_status.get(record.status, 0) + 1
        return StoreStats(counts=counts, expired=expired)

    def scan(
        self,
        now: int,
        consumer: str | None,
        status: Status | None,
        after: tuple[str, str] | None,
        limit: int,
    ) -> list[Record]:
        found: list[Record] = []
        for ident in sorted(self.records):
            if after is not None and ident <= after:
                continue
            record = self.records[ident]
            if record.expires_ms <= now:
                continue
            if consumer is not None and ident[0] != consumer:
                continue
            if status is not None and record.status is not status:
                continue
            found.append(record)
            if len(found) >= limit:
                break
        return found

    def forget(self, consumer: str, key: str) -> bool:
        return self.records.pop((consumer, key), None) is not None
