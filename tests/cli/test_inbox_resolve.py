"""``oncely inbox resolve`` and ``oncely reconcile`` against a real SQLite file (R10): an
operator settles an escalated or stuck record without a redelivery, and a live claim is never
overridden. The library's fencing is tested on every store in tests/contract/test_resolve.py.
"""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import pytest

import oncely
from oncely import Outcome, Status
from tests.cli.helpers import TOKEN, run, url_of


def _get(db: Path, consumer: str, key: str) -> oncely.Record | None:
    with closing(oncely.SQLiteStore(db)) as store:
        return store.get(consumer, key)


def _never(payload: object) -> object:
    raise AssertionError("the handler must not run")


def test_r10_resolve_a_stuck_claim_as_completed(db: Path) -> None:
    result = run("inbox", "resolve", "--store", url_of(db), "--consumer", "email", "msg-stale",
                 "--completed", '{"sent": true}')  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("resolved consumer 'email', key 'msg-stale': in_progress (")
    assert result.stdout.rstrip().endswith("-> completed")
    with closing(oncely.SQLiteStore(db)) as store:
        handled = oncely.Inbox(store, consumer="email").handle("msg-stale", {}, _never)
    assert handled.outcome is Outcome.DUPLICATE and handled.value == {"sent": True}


def test_r10_resolve_refuses_a_live_claim_and_changes_nothing(db: Path) -> None:
    before = _get(db, "email", "msg-live")
    for action in (["--retry"], ["--failed", "gave up"], ["--completed", "1"]):
        result = run("inbox", "resolve", "--store", url_of(db), "--consumer", "email",
                     "msg-live", *action)  # fmt: skip
        assert result.exit_code == 1
        assert "not resolved: 'msg-live' is held by a live claim (attempt 1" in result.stderr
        assert "resolve never overrides a running worker" in result.stderr
    after = _get(db, "email", "msg-live")
    assert after == before and after is not None and after.token == TOKEN


def test_resolve_retry_a_poison_message_and_refusals(db: Path) -> None:
    store = url_of(db)
    result = run("inbox", "resolve", "--store", store, "--consumer", "billing", "order-bad",
                 "--retry", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["action"] == "retry" and shown["after"] is None
    assert shown["before"]["status"] == "failed"
    assert _get(db, "billing", "order-bad") is None
    done = run("inbox", "resolve", "--store", store, "--consumer", "billing", "order-1",
               "--failed", "x")  # fmt: skip
    assert done.exit_code == 1 and "already completed" in done.stderr
    assert _get(db, "billing", "order-1") is not None
    nothing = run("inbox", "resolve", "--store", store, "--consumer", "billing", "nope", "--retry")
    assert nothing.exit_code == 1 and "nothing to retry" in nothing.stderr


def test_r20_a_poison_message_resolved_as_completed_still_conflicts_with_other_content(
    db: Path,
) -> None:
    """R20 step 6: after `resolve --completed` of a failed record, a message reusing its key
    for other content is a key conflict (dead-lettered, alerted), never a duplicate whose
    handler is skipped; the content first delivered is still a duplicate."""
    result = run("inbox", "resolve", "--store", url_of(db), "--consumer", "billing",
                 "order-bad", "--completed", '{"refunded": true}')  # fmt: skip
    assert result.exit_code == 0, result.stderr
    with closing(oncely.SQLiteStore(db)) as store:
        billing = oncely.Inbox(store, consumer="billing")
        other = billing.handle("order-bad", {"amount": 5}, _never)
        assert other.outcome is Outcome.KEY_CONFLICT
        same = billing.handle("order-bad", {"amount": -1}, _never)
        assert same.outcome is Outcome.DUPLICATE and same.value == {"refunded": True}


def test_resolve_usage_errors(db: Path) -> None:
    base = ("inbox", "resolve", "--store", url_of(db), "--consumer", "email", "msg-stale")
    assert run(*base).exit_code == 2
    assert run(*base, "--retry", "--failed", "x").exit_code == 2
    bad = run(*base, "--completed", "{not json")
    assert bad.exit_code == 2 and "not JSON" in bad.stderr
    assert run(*base, "--failed", " ").exit_code == 2
    # Python's JSON reader takes these; JSON has no such numbers, so a duplicate's caller
    # reading the result elsewhere could not.
    for constant in ("NaN", "[Infinity]", '{"a": -Infinity}'):
        refused = run(*base, "--completed", constant)
        assert refused.exit_code == 2 and "is not a JSON number" in refused.stderr, constant
    # A number past a double's range is read as infinity, and was stored as Infinity.
    for huge in ("1e999", '{"a": -1.5e400}'):
        refused = run(*base, "--completed", huge)
        assert refused.exit_code == 2 and "reads as infinity" in refused.stderr, huge
    # Before, it was written with an expiry past the year 9999, which `inbox show` then
    # could not read back.
    forever = run(*base, "--completed", "1", "--keep", "4000000d")
    assert forever.exit_code == 2 and "longer than any record can be kept" in forever.stderr
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.IN_PROGRESS


def test_resolve_shows_a_key_with_control_characters_escaped_once(db: Path) -> None:
    """Before, such a key was escaped and then quoted with repr, doubling every backslash
    (``'a\\nb'``): not the key the operator typed."""
    result = run("inbox", "resolve", "--store", url_of(db), "--consumer", "email", "a\nb\x1b",
                 "--completed", "1")  # fmt: skip
    assert result.exit_code == 1
    assert "has no record for key 'a\\nb\\x1b'" in result.stderr, result.stderr
    assert "\x1b" not in result.stderr.replace("\\x1b", "")  # no raw escape on the terminal


def test_r10_reconcile_dry_run_lists_the_stale_claims_only(db: Path) -> None:
    result = run("reconcile", "--store", url_of(db), "--consumer", "email", "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert [r["key"] for r in shown["results"]] == ["msg-stale"]
    text = run("reconcile", "--store", url_of(db), "--consumer", "email", "--dry-run")
    assert text.exit_code == 0, text.stderr
    # The state each is in, not a "change" from it to itself.
    assert text.stdout.startswith("msg-stale: in_progress (") and "->" not in text.stdout
    assert "1 stale claim(s) of consumer 'email' (dry run: nothing changed)" in text.stdout
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.token == TOKEN


def test_r10_reconcile_runs_the_reconciler_and_spares_the_live_claim(db: Path) -> None:
    result = run("reconcile", "--store", url_of(db), "--consumer", "email",
                 "--reconciler", "tests.cli.helpers:reconcile_sent")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("msg-stale: completed (in_progress (")
    assert "1 stale claim(s) of consumer 'email'" in result.stdout
    # The reconciler decided, and the output says so (it said "by an operator").
    assert "completed by the reconciler" in result.stdout and "operator" not in result.stdout
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.COMPLETED
    assert record.result == b'{"sent":"msg-stale"}'
    live = _get(db, "email", "msg-live")
    assert live is not None and live.status is Status.IN_PROGRESS and live.token == TOKEN
    again = run("reconcile", "--store", url_of(db), "--consumer", "email", "--on-stale", "retry")
    assert again.exit_code == 0 and "0 stale claim(s)" in again.stdout


def test_r10_reconcile_with_an_async_reconciler_or_escalation(db: Path) -> None:
    store = url_of(db)
    escalated = run("reconcile", "--store", store, "--consumer", "email", "--on-stale", "escalate")
    assert escalated.exit_code == 1 and "1 stale claim(s) left for a person" in escalated.stderr
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.IN_PROGRESS
    failed = run("reconcile", "--store", store, "--consumer", "email",
                 "--reconciler", "tests.cli.helpers:reconcile_async")  # fmt: skip
    assert failed.exit_code == 0, failed.stderr
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.FAILED
    assert record.error == "bounced: msg-stale"
    assert run("reconcile", "--store", store, "--consumer", "email").exit_code == 2
    missing = run("reconcile", "--store", store, "--consumer", "email", "--reconciler", "x:y")
    assert missing.exit_code == 2 and "cannot import 'x'" in missing.stderr


def test_r10_a_reconciler_that_returns_no_resolution_is_an_error_for_that_claim(db: Path) -> None:
    """Before, the whole run stopped with "AttributeError: 'str' object has no attribute
    'action'" (exit 5); now that claim is reported, unchanged, and the run exits 1."""
    result = run("reconcile", "--store", url_of(db), "--consumer", "email",
                 "--reconciler", "tests.cli.helpers:reconcile_wrongly")  # fmt: skip
    assert result.exit_code == 1, result.stderr
    assert "msg-stale: error" in result.stdout and "returned str, not an oncely.Resolution" in (
        result.stdout
    )
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.IN_PROGRESS and record.token == TOKEN


def test_r10_reconcile_and_resolve_take_keys_as_long_as_a_consumer_may_have(db: Path) -> None:
    """A consumer with ``--max-key-bytes 2048`` stored a 1000-byte key. Before, reconcile
    stopped its whole run on it (over the default 512 bytes, exit 5), leaving msg-stale
    unsettled too, and resolve refused to name it."""
    from tests.cli.helpers import PAST

    long_key = "k" * 1000
    with closing(oncely.SQLiteStore(db, clock=oncely.FakeClock(PAST))) as past:
        for key in (long_key, "also-" + "x" * 900):
            past.claim(
                "email", key, fingerprint=None, token=TOKEN,
                lease_ms=1000, keep_ms=100 * 365 * 86_400_000, takeover=False,
            )  # fmt: skip
    store = url_of(db)
    done = run("reconcile", "--store", store, "--consumer", "email", "--on-stale", "retry")
    assert done.exit_code == 0, done.stderr
    assert "3 stale claim(s)" in done.stdout
    assert _get(db, "email", long_key) is None and _get(db, "email", "msg-stale") is None
    kept = run("inbox", "resolve", "--store", store, "--consumer", "email", "also-" + "x" * 900,
               "--retry")  # fmt: skip
    assert kept.exit_code == 1 and "nothing to retry" in kept.stderr  # reconciled already


def test_resolve_refuses_a_key_with_no_record_unless_asked_to_create_one(db: Path) -> None:
    """Before, a mistyped key became a completed record at once (exit 0), and the real
    message, once delivered, was acknowledged as its duplicate without ever running."""
    store = url_of(db)
    base = ("inbox", "resolve", "--store", store, "--consumer", "billing", "order-99")
    typo = run(*base, "--completed", '{"ok": true}')
    assert typo.exit_code == 1 and "has no record for key 'order-99'" in typo.stderr
    assert _get(db, "billing", "order-99") is None
    ahead = run(*base, "--completed", '{"ok": true}', "--create")
    assert ahead.exit_code == 0, ahead.stderr
    assert ahead.stdout.rstrip().endswith("absent -> completed")
    record = _get(db, "billing", "order-99")
    assert record is not None and record.status is Status.COMPLETED


def test_r10_reconcile_given_both_a_reconciler_and_on_stale_says_not_both(db: Path) -> None:
    """Before, it answered "give --reconciler ... or --on-stale ..." to an operator who had
    given both, as though neither had been read."""
    result = run("reconcile", "--store", url_of(db), "--consumer", "email", "--on-stale",
                 "retry", "--reconciler", "tests.cli.helpers:reconcile_sent")  # fmt: skip
    assert result.exit_code == 2
    assert "not both" in result.stderr, result.stderr
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.token == TOKEN


def test_r10_reconcile_and_retry_of_a_misspelt_consumer_say_it_has_no_record_at_all(
    db: Path,
) -> None:
    """A consumer name with a typo has no stale claims, nor any record: reconcile said only
    "0 stale claim(s)" (exit 0, as though all were settled, while the real consumer's stuck
    claims stay stuck), and resolve --retry only "nothing to retry"."""
    store = url_of(db)
    typo = run("reconcile", "--store", store, "--consumer", "emial", "--on-stale", "retry")
    assert typo.exit_code == 0, typo.stderr
    assert "0 stale claim(s) of consumer 'emial'" in typo.stdout
    assert "consumer 'emial' has no live record at all in this store" in typo.stdout
    retry = run("inbox", "resolve", "--store", store, "--consumer", "emial", "msg-stale",
                "--retry")  # fmt: skip
    assert retry.exit_code == 1
    assert "consumer 'emial' has no live record at all in this store" in retry.stderr
    # A real consumer with nothing stale is not told its name may be wrong.
    fine = run("reconcile", "--store", store, "--consumer", "billing", "--on-stale", "retry")
    assert fine.exit_code == 0 and "no live record at all" not in fine.stdout
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.token == TOKEN


def test_a_reconciler_module_that_raises_on_import_is_a_usage_error(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module whose own code fails at import (a setting it reads is missing) was an
    "unexpected error", exit 5, as if oncely had failed; it is the command line's, exit 2,
    naming the module and the error."""
    (tmp_path / "opsfix_broken_reconciler.py").write_text(
        "raise RuntimeError('RECONCILE_URL is not set')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("reconcile", "--store", url_of(db), "--consumer", "email",
                 "--reconciler", "opsfix_broken_reconciler:decide")  # fmt: skip
    assert result.exit_code == 2, result.stderr
    assert "RuntimeError: RECONCILE_URL is not set" in result.stderr
    record = _get(db, "email", "msg-stale")
    assert record is not None and record.status is Status.IN_PROGRESS
