"""What the state-machine tests (``test_state_*.py``) share: the fixed clock and tokens, a
record builder, every record state of the table (``STATES``) with its groups, and the claim
event they all start from. Pure code, time passed in as a value.
"""

from __future__ import annotations

from oncely._core.records import Record, Status
from oncely._core.state import ClaimEvent

NOW = 10_000_000
LEASE = 30_000
KEEP = 3_600_000
OLD = "t-old"  # the token of the record in place
NEW = "t-new"  # the token of the incoming claim
WRONG = "t-wrong"
FP = "v1:aaaa"
OTHER_FP = "v1:bbbb"


def record(
    status: Status = Status.IN_PROGRESS,
    *,
    lease_until: int = NOW + 1,
    expires: int = NOW + KEEP,
    fingerprint: str | None = FP,
    token: str = OLD,
) -> Record:
    return Record(
        consumer="billing",
        key="order-1",
        status=status,
        fingerprint=fingerprint,
        token=token,
        attempt=2,
        created_ms=NOW - 50_000,
        updated_ms=NOW - 40_000,
        lease_until_ms=lease_until,
        expires_ms=expires,
        result=b'"stored"' if status is Status.COMPLETED else None,
        error="poison" if status is Status.FAILED else None,
    )


# Every record state of the table. "Expired" comes in every status and at the exact boundary
# (expires == now): an expired record is absent whatever it held.
STATES: dict[str, Record | None] = {
    "absent": None,
    "expired_in_progress": record(lease_until=NOW - 5, expires=NOW),
    "expired_in_progress_earlier": record(lease_until=NOW - 5, expires=NOW - 1),
    "expired_completed": record(Status.COMPLETED, lease_until=NOW - 5, expires=NOW),
    "expired_completed_lease_ahead": record(Status.COMPLETED, lease_until=NOW + 5, expires=NOW),
    "expired_failed": record(Status.FAILED, lease_until=NOW - 5, expires=NOW - 100),
    "live": record(lease_until=NOW + 1),
    "stale": record(lease_until=NOW - 1),
    "stale_at_boundary": record(lease_until=NOW),  # lease_until == now has lapsed
    "completed": record(Status.COMPLETED, lease_until=NOW - 1),
    "completed_lease_ahead": record(Status.COMPLETED, lease_until=NOW + 1_000),
    "failed": record(Status.FAILED, lease_until=NOW - 1),
}

ABSENT = [s for s in STATES if s == "absent" or s.startswith("expired")]
STALE = ["stale", "stale_at_boundary"]
COMPLETED = ["completed", "completed_lease_ahead"]


def _claim_ev(*, takeover: bool, fingerprint: str | None = FP) -> ClaimEvent:
    return ClaimEvent("billing", "order-1", fingerprint, NEW, LEASE, KEEP, takeover)
