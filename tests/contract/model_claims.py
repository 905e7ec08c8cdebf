"""The claim side of the reference model's state machine: claims, takeovers of lapsed leases
and transactional claims, each checked against the model (R7, R8, R10).

Random claims rarely land in the window between a lease's end and the record's, so some rules
aim there on purpose. The machine that runs these rules with the fenced writes, reads and clock
steps is in test_model_stateful.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from oncely._core.records import Status
from oncely._core.state import ClaimEvent, TakeoverEvent, apply_claim
from tests.contract.model_helpers import (
    BOGUS,
    FINGERPRINTS,
    KEEPS,
    LEASES,
    RESULTS,
    Issued,
    StoreAndModel,
    consumers,
    fingerprints,
    keys,
    tokens,
)


class _Rollback(Exception):
    """Raised inside a transaction to roll it back."""


class ClaimRules(StoreAndModel):
    """The rules that claim a record, take one over or claim inside a transaction; each
    returns the token it issued, for the fenced writes to aim with."""

    @rule(
        target=tokens,
        consumer=consumers,
        key=keys,
        fingerprint=fingerprints,
        takeover=st.booleans(),
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def claim(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        return self._claim(consumer, key, fingerprint, takeover, lease_ms, keep_ms)

    def _claim(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        token = self._token()
        event = ClaimEvent(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        now = self.clock.now_ms()
        self._same(
            "claim",
            lambda: self.store.claim(
                consumer,
                key,
                fingerprint=fingerprint,
                token=token,
                lease_ms=lease_ms,
                keep_ms=keep_ms,
                takeover=takeover,
            ),
            lambda: self.model.claim(event, now),
        )
        return Issued(consumer, key, token)

    def _in_progress(self) -> list[tuple[str, str]]:
        now = self.clock.now_ms()
        return sorted(
            ident
            for ident, record in self.model.records.items()
            if not record.is_expired(now) and record.status is Status.IN_PROGRESS
        )

    def _lapse(self, data: st.DataObject) -> tuple[str, str]:
        """An in-progress record whose lease has lapsed: a stale one, or a live one with the
        clock moved exactly to its lease's end (the boundary: ``lease_until == now`` is stale)."""
        ident = data.draw(st.sampled_from(self._in_progress()), label="in-progress record")
        record = self.model.records[ident]
        if record.is_live(self.clock.now_ms()):
            self.clock.set(record.lease_until_ms)
        return ident

    def _fingerprint_for(self, ident: tuple[str, str], relation: str) -> str | None:
        """A fingerprint that agrees with the record's (``same``, ``none``) or conflicts."""
        stored = self.model.records[ident].fingerprint
        if relation == "same":
            return stored
        if relation == "none":
            return None
        return FINGERPRINTS[2] if stored == FINGERPRINTS[1] else FINGERPRINTS[1]

    relations = st.sampled_from(["same", "none", "other"])

    @precondition(lambda self: bool(self._in_progress()))
    @rule(
        target=tokens,
        data=st.data(),
        relation=relations,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def claim_a_stale_record(
        self, data: st.DataObject, relation: str, lease_ms: int, keep_ms: int
    ) -> Issued:
        """A redelivery finds a lapsed lease and takes it over (R10), unless its content
        conflicts; aimed on purpose, since random claims rarely land in the window between a
        lease's end and the record's."""
        ident = self._lapse(data)
        fingerprint = self._fingerprint_for(ident, relation)
        return self._claim(*ident, fingerprint, True, lease_ms, keep_ms)

    @precondition(lambda self: bool(self._in_progress()))
    @rule(
        target=tokens,
        data=st.data(),
        right_token=st.booleans(),
        relation=relations,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def takeover_a_stale_record(
        self,
        data: st.DataObject,
        right_token: bool,
        relation: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        """A reconciler decided to retry the lapsed claim it looked at (R10), or one that was
        already taken over since (its token is outdated)."""
        ident = self._lapse(data)
        seen = self.model.records[ident].token if right_token else BOGUS
        fingerprint = self._fingerprint_for(ident, relation)
        return self._takeover(*ident, seen, fingerprint, lease_ms, keep_ms)

    @rule(
        target=tokens,
        expected=tokens,
        known=st.sampled_from(["current", "current", "issued", "bogus"]),
        fingerprint=fingerprints,
        lease_ms=st.sampled_from(LEASES),
        keep_ms=st.sampled_from(KEEPS),
    )
    def takeover(
        self,
        expected: Issued,
        known: str,
        fingerprint: str | None,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        """A reconciler's takeover, expecting the token it saw on the record: the current one,
        one issued earlier for that record (maybe outdated), or one nobody issued."""
        consumer, key = expected.consumer, expected.key
        expected_token = {
            "current": self._current_token(consumer, key) or expected.token,
            "issued": expected.token,
            "bogus": BOGUS,
        }[known]
        return self._takeover(consumer, key, expected_token, fingerprint, lease_ms, keep_ms)

    def _takeover(
        self,
        consumer: str,
        key: str,
        expected_token: str,
        fingerprint: str | None,
        lease_ms: int,
        keep_ms: int,
    ) -> Issued:
        token = self._token()
        event = TakeoverEvent(
            ClaimEvent(consumer, key, fingerprint, token, lease_ms, keep_ms, True), expected_token
        )
        now = self.clock.now_ms()
        self._same(
            "takeover",
            lambda: self.store.takeover(
                consumer,
                key,
                expected_token=expected_token,
                fingerprint=fingerprint,
                token=token,
                lease_ms=lease_ms,
                keep_ms=keep_ms,
            ),
            lambda: self.model.takeover(event, now),
        )
        return Issued(consumer, key, token)

    @precondition(lambda self: self.transactional)
    @rule(
        target=tokens,
        consumer=consumers,
        key=keys,
        fingerprint=fingerprints,
        takeover=st.booleans(),
        keep_ms=st.sampled_from(KEEPS),
        initial=st.sampled_from([Status.COMPLETED, Status.FAILED]),
        result=RESULTS,
        commit=st.booleans(),
    )
    def claim_in_transaction(
        self,
        consumer: str,
        key: str,
        fingerprint: str | None,
        takeover: bool,
        keep_ms: int,
        initial: Status,
        result: bytes | None,
        commit: bool,
    ) -> Issued:
        """Transactional mode (R7): the marker is inserted settled, with the result set in the
        same transaction; a rolled-back transaction leaves the store as it was."""
        store: Any = self.store  # a transactional store (see the precondition)
        token = self._token()
        error = "poison message" if initial is Status.FAILED else None
        event = ClaimEvent(consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error)
        now = self.clock.now_ms()
        ident = (consumer, key)
        # The answer the model would give, without writing it yet: the transaction may roll back.
        _, expected = apply_claim(self.model.records.get(ident), event, now)
        try:
            with store.transaction() as tx:
                got = store.claim_in(
                    tx,
                    consumer,
                    key,
                    fingerprint=fingerprint,
                    token=token,
                    keep_ms=keep_ms,
                    takeover=takeover,
                    initial=initial,
                    error=error,
                )
                assert got == expected, f"claim_in: store answered {got}, model {expected}"
                if got.won:
                    store.set_result_in(tx, consumer, key, token=token, result=result)
                if not commit:
                    raise _Rollback
        except _Rollback:
            assert not commit
        if commit:
            self.model.claim(event, now)
            if expected.won:
                self.model.records[ident] = replace(self.model.records[ident], result=result)
        return Issued(consumer, key, token)
