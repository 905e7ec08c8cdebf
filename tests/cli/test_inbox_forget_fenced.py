"""``oncely inbox forget`` on every store: it never deletes a claim a worker holds unless told
(--force), and a stale claim is deleted only while it is the claim the operator was shown: a
worker that comes back (renews) during the confirmation, or another that takes the claim over,
keeps it (R8, R10)."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import oncely
from oncely import Status
from tests.cli.conftest import StoreUrl
from tests.cli.helpers import run

LONG = 3_600_000
LAPSE = 60  # ms: a lease that lapses before the test goes on


def _claim(store: oncely.Store, key: str, token: str, lease_ms: int) -> None:
    claim = store.claim("c", key, fingerprint=None, token=token, lease_ms=lease_ms,
                        keep_ms=LONG, takeover=False)  # fmt: skip
    assert claim.won
    if lease_ms == LAPSE:
        time.sleep(LAPSE * 2 / 1000)


class _Answer(io.BytesIO):
    """The operator's "y" to the confirmation, with ``meanwhile`` done while they read it."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        super().__init__(b"y\n")
        self._meanwhile: Callable[[], None] | None = meanwhile

    def _first(self, size: int | None) -> None:
        if self._meanwhile is not None and size != 0:  # read(0): click checking the stream
            self._meanwhile()
            self._meanwhile = None

    def read(self, size: int | None = -1) -> bytes:
        self._first(size)
        return super().read(size)

    def read1(self, size: int | None = -1) -> bytes:
        self._first(size)
        return super().read1(size)

    def readline(self, size: int | None = -1) -> bytes:
        self._first(size)
        return super().readline(size)


def test_r10_forget_refuses_a_live_claim_unless_forced(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    _claim(made, "running", "worker", LONG)
    refused = run("inbox", "forget", "--store", url, "--consumer", "c", "running", "--yes")
    assert refused.exit_code == 1
    assert "live claim" in refused.stderr and "--force" in refused.stderr
    held = made.get("c", "running")
    assert held is not None and held.token == "worker" and held.status is Status.IN_PROGRESS
    forced = run("inbox", "forget", "--store", url, "--consumer", "c", "running", "--yes",
                 "--force")  # fmt: skip
    assert forced.exit_code == 0, forced.stderr
    assert made.get("c", "running") is None


def test_r10_forget_spares_a_worker_that_came_back_while_asked(
    each_store: StoreUrl,
) -> None:
    made, url, _ = each_store
    _claim(made, "slow", "worker", LAPSE)

    def renew() -> None:  # the worker was only slow: its heartbeat renews its claim
        made.renew("c", "slow", token="worker", lease_ms=LONG, keep_ms=LONG)

    result = run("inbox", "forget", "--store", url, "--consumer", "c", "slow",
                 stdin=_Answer(renew))  # type: ignore[arg-type]  # fmt: skip
    assert result.exit_code == 1
    assert "changed meanwhile" in result.stderr
    kept = made.get("c", "slow")
    assert kept is not None and kept.token == "worker" and kept.status is Status.IN_PROGRESS
    made.complete("c", "slow", token="worker", result=None, keep_ms=LONG)  # still the worker's


def test_r10_forget_spares_a_claim_taken_over_while_asked(each_store: StoreUrl) -> None:
    made, url, _ = each_store
    _claim(made, "stuck", "dead", LAPSE)

    def take_over() -> None:  # a redelivery takes the stale claim over and runs the handler
        claim = made.claim("c", "stuck", fingerprint=None, token="redelivery", lease_ms=LONG,
                           keep_ms=LONG, takeover=True)  # fmt: skip
        assert claim.won

    result = run("inbox", "forget", "--store", url, "--consumer", "c", "stuck",
                 stdin=_Answer(take_over))  # type: ignore[arg-type]  # fmt: skip
    assert result.exit_code == 1
    assert "changed meanwhile" in result.stderr
    kept = made.get("c", "stuck")
    assert kept is not None and kept.token == "redelivery"
    # With nothing in its way, a stale claim is forgotten as asked.
    _claim(made, "lapsed", "dead", LAPSE)
    agreed = run("inbox", "forget", "--store", url, "--consumer", "c", "lapsed", stdin="y\n")
    assert agreed.exit_code == 0, agreed.stderr
    assert "in_progress" in agreed.stderr  # the prompt said what is deleted
    assert made.get("c", "lapsed") is None
