"""Operations without a redelivery (R10): an operator resolves an escalated or stuck record by
hand, and ``reconcile`` runs the consumer's reconciler over stale claims now. On every store,
with real threads: a live owner is never overridden (every write is fenced by a takeover the
store refuses while the lease is live), and a lapsed owner that comes back loses its claim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely import Outcome, Resolution, ResolveRefused, StaleClaim, Status
from tests.backends import Backend, Scope

LONG = 3_600_000
LAPSE = 60  # ms: a lease that lapses before the test goes on
PAYLOAD = {"order": 7}


def _inbox(store: oncely.Store, **options: Any) -> oncely.Inbox:
    return oncely.Inbox(store, consumer="c", lease=oncely.Lease(duration=timedelta(seconds=2)),
                        **options)  # fmt: skip


def _lapsed(store: oncely.Store, key: str, token: str = "t0") -> None:
    """An in-progress record whose worker died: its lease has lapsed, nobody took it over."""
    claim = store.claim("c", key, fingerprint=oncely.fingerprint(PAYLOAD), token=token,
                        lease_ms=LAPSE, keep_ms=LONG, takeover=False)  # fmt: skip
    assert claim.won
    time.sleep(LAPSE * 2 / 1000)


def _never(payload: object) -> object:
    raise AssertionError("the handler must not run")


@pytest.fixture
def store(backend: Backend, scope: Scope) -> Iterator[oncely.Store]:
    # Closed here, not left to the garbage collector: a PostgreSQL store's pool collected
    # while Python 3.13 shuts down waits 5 s for each of its threads, which no longer run then.
    made = backend.make_sync(scope, None)
    try:
        made.migrate()
        yield made
    finally:
        made.close()


def test_r10_resolve_completes_a_stuck_claim_and_fences_its_old_owner(store: oncely.Store) -> None:
    inbox = _inbox(store)
    _lapsed(store, "k")
    done = inbox.resolve("k", Resolution.completed({"charged": 7}))
    assert done.action == "completed" and done.before is not None and done.after is not None
    assert done.before.status is Status.IN_PROGRESS and done.before.token == "t0"
    after = done.after
    assert after.status is Status.COMPLETED and after.attempt == 2 and after.token != "t0"
    assert after.error == "resolved as completed by an operator"  # the note, kept on the record
    # Its deliveries are duplicates answered with the operator's result.
    handled = inbox.handle("k", PAYLOAD, _never)
    assert handled.outcome is Outcome.DUPLICATE and handled.value == {"charged": 7}
    # The worker that lost the claim cannot settle it any more.
    with pytest.raises(oncely.LeaseLost):
        store.complete("c", "k", token="t0", result=b"late", keep_ms=LONG)
    assert store.get("c", "k") == after


def test_r10_resolve_never_overrides_a_live_worker(store: oncely.Store) -> None:
    inbox = _inbox(store)
    started, finish = threading.Event(), threading.Event()
    results: list[oncely.Handled[Any]] = []

    def slow(payload: object) -> str:
        started.set()
        assert finish.wait(30)
        return "worker's"

    worker = threading.Thread(target=lambda: results.append(inbox.handle("k", PAYLOAD, slow)))
    worker.start()
    try:
        assert started.wait(30)
        held = store.get("c", "k")
        assert held is not None and held.status is Status.IN_PROGRESS
        for resolution in (Resolution.completed("operator's"), Resolution.failed("no"),
                           Resolution.retry()):  # fmt: skip
            with pytest.raises(ResolveRefused, match="held by a live claim") as refused:
                inbox.resolve("k", resolution)
            assert refused.value.current is not None
            assert refused.value.current.token == held.token
        now = store.get("c", "k")
        assert now is not None and now.token == held.token and now.status is Status.IN_PROGRESS
    finally:
        finish.set()
        worker.join(30)
    assert results[0].outcome is Outcome.PROCESSED and results[0].value == "worker's"
    assert inbox.handle("k", PAYLOAD, _never).value == "worker's"


def test_r10_resolve_retry_and_failed_on_a_stuck_claim(store: oncely.Store) -> None:
    inbox = _inbox(store)
    _lapsed(store, "again")
    retried = inbox.resolve("again", Resolution.retry())
    assert retried.action == "retry" and retried.after is None
    assert store.get("c", "again") is None
    ran: list[object] = []
    handled = inbox.handle("again", PAYLOAD, lambda p: ran.append(p) or "ok")
    assert handled.outcome is Outcome.PROCESSED and ran == [PAYLOAD]

    _lapsed(store, "poison")
    failed = inbox.resolve("poison", Resolution.failed("refund by hand, ticket 42"))
    assert failed.after is not None and failed.after.status is Status.FAILED
    assert failed.after.error == "refund by hand, ticket 42"
    handled = inbox.handle("poison", PAYLOAD, _never)
    assert handled.outcome is Outcome.REJECTED and "ticket 42" in (handled.reason or "")


def test_r10_resolve_a_failed_record_or_an_absent_key(store: oncely.Store) -> None:
    inbox = _inbox(store)
    inbox.handle("bad", PAYLOAD, _raise_reject)
    with pytest.raises(ResolveRefused, match="already failed"):
        inbox.resolve("bad", Resolution.failed("again"))
    fixed = inbox.resolve("bad", Resolution.completed({"fixed": True}))
    assert fixed.before is not None and fixed.before.status is Status.FAILED
    assert fixed.after is not None and fixed.after.status is Status.COMPLETED
    assert inbox.handle("bad", PAYLOAD, _never).value == {"fixed": True}
    with pytest.raises(ResolveRefused, match=r"already completed; .* forget it"):
        inbox.resolve("bad", Resolution.retry())

    inbox.handle("bad-2", PAYLOAD, _raise_reject)
    assert inbox.resolve("bad-2", Resolution.retry()).after is None
    assert inbox.handle("bad-2", PAYLOAD, lambda p: "second run").outcome is Outcome.PROCESSED

    with pytest.raises(ResolveRefused, match="nothing to retry"):
        inbox.resolve("never-seen", Resolution.retry())
    made = inbox.resolve("never-seen", Resolution.completed(None), note="done in the old system")
    assert made.before is None and made.after is not None
    assert made.after.status is Status.COMPLETED and made.after.error == "done in the old system"
    assert inbox.handle("never-seen", PAYLOAD, _never).outcome is Outcome.DUPLICATE
    with pytest.raises(oncely.ConfigurationError, match="resolve takes"):
        inbox.resolve("x", Resolution.escalate("?"))


def _raise_reject(payload: object) -> None:
    raise oncely.Reject("poison")


def test_r10_reconcile_asks_the_reconciler_about_stale_claims_only(store: oncely.Store) -> None:
    answers = {
        "paid": Resolution.completed({"paid": True}),
        "unpaid": Resolution.retry(),
        "refused": Resolution.failed("the provider refused the card"),
        "unsure": Resolution.escalate("the provider does not answer"),
    }
    asked: list[StaleClaim] = []

    def reconciler(stale: StaleClaim) -> Resolution:
        asked.append(stale)
        if stale.record.key == "broken":
            raise RuntimeError("provider down")
        return answers[stale.record.key]

    inbox = _inbox(store, on_stale=reconciler)
    for key in (*answers, "broken"):
        _lapsed(store, key, token=f"old-{key}")
    inbox.handle("finished", PAYLOAD, lambda p: "x")
    live = store.claim("c", "running", fingerprint=None, token="live", lease_ms=LONG,
                       keep_ms=LONG, takeover=False)  # fmt: skip
    assert live.won

    report = {r.key: r for r in inbox.reconcile()}
    assert sorted(s.record.key for s in asked) == sorted((*answers, "broken"))
    assert all(s.payload is None for s in asked)  # no delivery: nothing to show
    assert {k: r.action for k, r in report.items()} == {
        "paid": "completed",
        "unpaid": "retry",
        "refused": "failed",
        "unsure": "escalate",
        "broken": "error",
    }
    assert "provider down" in report["broken"].detail
    paid = store.get("c", "paid")
    assert paid is not None and paid.status is Status.COMPLETED
    assert store.get("c", "unpaid") is None
    refused = store.get("c", "refused")
    assert refused is not None and refused.status is Status.FAILED
    for untouched in ("unsure", "broken"):
        record = store.get("c", untouched)
        assert record is not None and record.token == f"old-{untouched}"
    running = store.get("c", "running")
    assert running is not None and running.token == "live"  # never asked, never touched
    assert inbox.reconcile(limit=1)[0].key in ("broken", "unsure")


def test_r10_reconcile_skips_a_worker_that_came_back(store: oncely.Store) -> None:
    """The worker's lease lapsed, the reconciler is asked, and meanwhile the worker renews
    (nobody had taken its claim over, so it may): the reconcile's takeover is refused."""
    _lapsed(store, "slow", token="owner")

    def reconciler(stale: StaleClaim) -> Resolution:
        store.renew("c", "slow", token="owner", lease_ms=LONG, keep_ms=LONG)
        return Resolution.retry()

    (only,) = _inbox(store, on_stale=reconciler).reconcile()
    assert only.action == "skipped" and "live claim" in only.detail
    record = store.get("c", "slow")
    assert record is not None and record.token == "owner" and record.status is Status.IN_PROGRESS
    store.complete("c", "slow", token="owner", result=None, keep_ms=LONG)  # still the owner's


def test_r10_reconcile_with_the_plain_policies(store: oncely.Store) -> None:
    _lapsed(store, "a", token="ta")
    (escalated,) = _inbox(store, on_stale="escalate").reconcile()
    assert escalated.action == "escalate"
    record = store.get("c", "a")
    assert record is not None and record.token == "ta"
    (retried,) = _inbox(store, on_stale="retry").reconcile()
    assert retried.action == "retry" and store.get("c", "a") is None
    assert _inbox(store).reconcile() == []


async def test_r10_the_async_inbox_resolves_and_reconciles(backend: Backend, scope: Scope) -> None:
    store = backend.make_async(scope, None)
    await store.migrate()
    inbox = oncely.AsyncInbox(store, consumer="c", on_stale="retry")
    live = await store.claim("c", "live", fingerprint=None, token="live", lease_ms=LONG,
                             keep_ms=LONG, takeover=False)  # fmt: skip
    assert live.won
    with pytest.raises(ResolveRefused, match="held by a live claim"):
        await inbox.resolve("live", Resolution.completed(1))
    for key in ("stuck", "lapsed"):
        claim = await store.claim("c", key, fingerprint=None, token=key, lease_ms=LAPSE,
                                  keep_ms=LONG, takeover=False)  # fmt: skip
        assert claim.won
    time.sleep(LAPSE * 2 / 1000)
    done = await inbox.resolve("stuck", Resolution.completed({"by": "hand"}))
    assert done.after is not None and done.after.status is Status.COMPLETED
    (retried,) = await inbox.reconcile()
    assert retried.key == "lapsed" and retried.action == "retry"
    assert await store.get("c", "lapsed") is None
    still = await store.get("c", "live")
    assert still is not None and still.token == "live"
    await store.aclose()


MONTH = 30 * 86_400_000


def test_r13_a_resolution_never_cuts_a_record_short(store: oncely.Store) -> None:
    """The consumer keeps its records 30 days; the operator's inbox (``oncely inbox resolve``
    and ``oncely reconcile`` with --keep left at 7d, here one hour) must not shorten them: a
    message resubmitted from the dead-letter queue after the shorter time would find no record
    and run again."""
    hour = timedelta(hours=1)
    operator = _inbox(store, retention=oncely.Retention(keep=hour))
    for key in ("done", "poison", "reconciled"):
        claim = store.claim("c", key, fingerprint=oncely.fingerprint(PAYLOAD), token=key,
                            lease_ms=LAPSE, keep_ms=MONTH, takeover=False)  # fmt: skip
        assert claim.won
    time.sleep(LAPSE * 2 / 1000)

    def kept(record: oncely.Record | None) -> int:
        assert record is not None
        return record.expires_ms - record.updated_ms

    done = operator.resolve("done", Resolution.completed({"charged": 7}))
    assert done.after is not None and kept(done.after) >= MONTH
    assert kept(store.get("c", "done")) >= MONTH
    poison = operator.resolve("poison", Resolution.failed("refunded by hand"))
    assert kept(poison.after) >= MONTH
    fixed = operator.resolve("poison", Resolution.completed({"fixed": True}))  # failed -> done
    assert kept(fixed.after) >= MONTH
    reconciling = _inbox(store, retention=oncely.Retention(keep=hour),
                         on_stale=lambda stale: Resolution.completed("found"))  # fmt: skip
    (reconciled,) = reconciling.reconcile()
    assert reconciled.action == "completed" and kept(reconciled.after) >= MONTH
    # A record meant to live shorter than the operator's retention gets the operator's.
    short = store.claim("c", "short", fingerprint=None, token="s", lease_ms=LAPSE,
                        keep_ms=60_000, takeover=False)  # fmt: skip
    assert short.won
    time.sleep(LAPSE * 2 / 1000)
    settled = operator.resolve("short", Resolution.completed(None))
    assert settled.after is not None and kept(settled.after) == 3_600_000


OTHER = {"order": 8}


def test_r20_resolve_keeps_the_fingerprint_so_other_content_is_still_a_conflict(
    store: oncely.Store,
) -> None:
    """R20 step 6: a key reused for other content is a key conflict, never a duplicate. An
    operator's resolve settles the record's outcome, not the message it stands for: the
    record keeps the fingerprint of the content first delivered, through every resolve of a
    record that has one (a failed record resolved as completed is deleted and written
    afresh; a stuck claim is taken over, then completed or failed)."""
    inbox = _inbox(store)
    fp = oncely.fingerprint(PAYLOAD)
    inbox.handle("bad", PAYLOAD, _raise_reject)
    fixed = inbox.resolve("bad", Resolution.completed({"fixed": True}))
    assert fixed.after is not None and fixed.after.fingerprint == fp
    _lapsed(store, "stuck-done")
    done = inbox.resolve("stuck-done", Resolution.completed({"charged": 7}))
    assert done.after is not None and done.after.fingerprint == fp
    _lapsed(store, "stuck-failed")
    failed = inbox.resolve("stuck-failed", Resolution.failed("by hand"))
    assert failed.after is not None and failed.after.fingerprint == fp
    for key in ("bad", "stuck-done", "stuck-failed"):
        record = store.get("c", key)
        assert record is not None and record.fingerprint == fp, key
        other = inbox.handle(key, OTHER, _never)
        assert other.outcome is Outcome.KEY_CONFLICT, (key, other)
        assert inbox.handle(key, PAYLOAD, _never).outcome in (Outcome.DUPLICATE,
                                                              Outcome.REJECTED)  # fmt: skip
    # Retry deletes the record: the next delivery runs the handler, whatever it carries.
    inbox.handle("again", PAYLOAD, _raise_reject)
    assert inbox.resolve("again", Resolution.retry()).after is None
    assert inbox.handle("again", OTHER, lambda p: "ran").outcome is Outcome.PROCESSED
