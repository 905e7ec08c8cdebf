"""The decision after a claim (:func:`oncely._core.flows.decide`): every step, and the key
conflict taking precedence over every status (R20 step 6: a reused id is never acknowledged as a
duplicate nor taken over)."""

from __future__ import annotations

import pytest

from oncely._core.flows import Step, decide
from oncely._core.records import Claim, ClaimStatus, Record, Status

NOW = 5_000_000
FP = "v1:aaaa"
OTHER = "v1:bbbb"


def claim(
    status: Status,
    *,
    lease_until: int = NOW - 1,
    stored_fp: str | None = FP,
    claim_status: ClaimStatus = ClaimStatus.EXISTING,
) -> Claim:
    rec = Record(
        consumer="c",
        key="k",
        status=status,
        fingerprint=stored_fp,
        token="t",
        attempt=1,
        created_ms=NOW - 100,
        updated_ms=NOW - 100,
        lease_until_ms=lease_until,
        expires_ms=NOW + 60_000,
    )
    return Claim(claim_status, rec, NOW)


# (status, lease_until) -> the step when the fingerprints agree
EXISTING_CASES = [
    (Status.COMPLETED, NOW - 1, Step.DUPLICATE),
    (Status.COMPLETED, NOW + 1, Step.DUPLICATE),  # a settled record's lease is meaningless
    (Status.FAILED, NOW - 1, Step.FAILED_BEFORE),
    (Status.FAILED, NOW + 1, Step.FAILED_BEFORE),
    (Status.IN_PROGRESS, NOW + 1, Step.IN_FLIGHT),
    (Status.IN_PROGRESS, NOW, Step.STALE),  # lease_until == now: lapsed
    (Status.IN_PROGRESS, NOW - 1, Step.STALE),
]


@pytest.mark.parametrize(("status", "lease_until", "step"), EXISTING_CASES)
@pytest.mark.parametrize(("stored", "incoming"), [(FP, FP), (None, FP), (FP, None), (None, None)])
def test_r1_r10_step_for_an_existing_record(
    status: Status, lease_until: int, step: Step, stored: str | None, incoming: str | None
) -> None:
    assert decide(claim(status, lease_until=lease_until, stored_fp=stored), incoming) is step


@pytest.mark.parametrize(("status", "lease_until", "_step"), EXISTING_CASES)
def test_r20_conflict_takes_precedence_over_every_status(
    status: Status, lease_until: int, _step: Step
) -> None:
    assert decide(claim(status, lease_until=lease_until), OTHER) is Step.CONFLICT


def test_r10_liveness_is_judged_on_the_claims_clock_reading() -> None:
    # The store's clock reading travels with the claim; decide never reads a clock itself.
    c = claim(Status.IN_PROGRESS, lease_until=NOW + 1)
    assert decide(c, FP) is Step.IN_FLIGHT
    later = Claim(c.status, c.record, NOW + 1)
    assert decide(later, FP) is Step.STALE


@pytest.mark.parametrize("claim_status", [ClaimStatus.NEW, ClaimStatus.TAKEN_OVER])
@pytest.mark.parametrize("incoming", [FP, OTHER, None])
def test_r8_a_won_claim_proceeds(claim_status: ClaimStatus, incoming: str | None) -> None:
    # The store only lets a claim win when the fingerprints agree (or the record was absent),
    # so a won claim runs the handler whatever the stored fingerprint says.
    c = claim(Status.IN_PROGRESS, lease_until=NOW + 30_000, claim_status=claim_status)
    assert decide(c, incoming) is Step.PROCEED


def test_every_step_is_reachable() -> None:
    seen = {decide(claim(s, lease_until=lu), FP) for s, lu, _ in EXISTING_CASES}
    seen.add(decide(claim(Status.COMPLETED), OTHER))
    seen.add(decide(claim(Status.IN_PROGRESS, claim_status=ClaimStatus.NEW), FP))
    assert seen == set(Step)
