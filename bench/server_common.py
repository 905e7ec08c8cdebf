"""What the servers section's cases share (``bench/servers.py``): the run's identity and the
servers' URLs, the fingerprint, lease and tokens the raw floors send, the variants and groups
a case measures, the batch-claim variants, and the ``Server`` base class."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cases import AMOUNT_CENTS, CHUNK, BenchError, Resources, expect, order, trivial

import oncely

if TYPE_CHECKING:
    from server_trips import Trips

RUN = os.urandom(3).hex()
LEASE_MS = oncely.Lease().duration_ms
KEEP_MS = oncely.Retention().keep_ms
SPAN_MS = max(KEEP_MS, LEASE_MS)
FP = oncely.fingerprint(order(0))
"""The raw floors send a fingerprint of the same size as oncely's, computed once: the floor
measures the driver and the server, not oncely's Python."""


def _env(*names: str, default: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return default


POSTGRES_URL = _env(
    "ONCELY_BENCH_POSTGRES_URL",
    "ONCELY_TEST_POSTGRES_DSN",
    default="postgresql://postgres@127.0.0.1:5432/test",
)
MYSQL_URL = _env(
    "ONCELY_BENCH_MYSQL_URL", "ONCELY_TEST_MYSQL_URL", default="mysql://root@127.0.0.1:3306/test"
)
REDIS_URL = _env(
    "ONCELY_BENCH_REDIS_URL", "ONCELY_TEST_REDIS_URL", default="redis://127.0.0.1:6379/0"
)


def with_option(url: str, name: str, value: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{name}={value}"


def driver(name: str) -> Any:
    """A driver module (or an oncely module that needs one), imported on first use: a missing
    driver skips its store instead of failing the whole run."""
    return importlib.import_module(name)


def answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


class Tokens:
    """Fencing tokens for the raw floors, made the way oncely makes them (a random prefix and
    a counter): unique, and as cheap as oncely's."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


# --------------------------------------------------------------------------- cases


@dataclass
class Variant:
    """One way of processing a batch of messages: ``new`` for fresh keys, ``dup`` for the same
    keys again (None where only new keys make sense). Each checks its own outcomes."""

    name: str
    new: Callable[[list[tuple[str, Any]]], None]
    dup: Callable[[list[tuple[str, Any]]], None] | None = None


@dataclass
class Group:
    """Variants compared with one another, side by side: the first is the baseline."""

    store: str
    kind: str  # "twophase" | "tx" | "batch"
    variants: list[Variant]
    sample: int = CHUNK
    """Messages per timed sample (each sample is timed alone, after a collection)."""


def oncely_variants(inbox: Any) -> Variant:
    def new(msgs: list[tuple[str, Any]]) -> None:
        for k, p in msgs:
            expect(inbox.handle(k, p, trivial), oncely.Outcome.PROCESSED)

    def dup(msgs: list[tuple[str, Any]]) -> None:
        for k, p in msgs:
            expect(inbox.handle(k, p, trivial), oncely.Outcome.DUPLICATE)

    return Variant("oncely", new, dup)


BATCH = 100
"""Keys per ``claim_many`` call."""

BATCH_SAMPLE = 5 * BATCH
"""Messages per timed sample of the batch group: five ``claim_many`` calls (and 500 single
claims). One call of 100 keys lasts about a millisecond, and a sample that short is mostly
the fixed cost of starting one (cold caches after the collection that precedes every sample),
which 100 single claims, ten times longer, amortise: the ratio would compare the two unequally.
"""


def batch_variants(store: Any, consumer: str) -> list[Variant]:
    """Single ``store.claim`` calls against ``store.claim_many`` of the same keys, 100 per call
    (fresh keys, precomputed fingerprint: the store's work alone)."""
    tokens = Tokens()

    def each(msgs: list[tuple[str, Any]]) -> None:
        for k, _p in msgs:
            claim = store.claim(
                consumer,
                k,
                fingerprint=FP,
                token=tokens(),
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=True,
            )
            if claim.status is not oncely.stores.ClaimStatus.NEW:
                raise BenchError(f"claim of new key {k!r}: {claim.status}")

    def many(msgs: list[tuple[str, Any]]) -> None:
        for start in range(0, len(msgs), BATCH):
            part = msgs[start : start + BATCH]
            claims = store.claim_many(
                consumer,
                [oncely.stores.ClaimRequest(k, FP, tokens()) for k, _p in part],
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=True,
            )
            if len(claims) != len(part) or any(
                c.status is not oncely.stores.ClaimStatus.NEW for c in claims
            ):
                raise BenchError("claim_many of new keys did not win every key")

    return [Variant("store.claim x100", each), Variant("store.claim_many(100)", many)]


def batch_group(store_name: str, store: Any) -> Group:
    """The batch group of one store (see :data:`BATCH_SAMPLE`)."""
    return Group(store_name, "batch", batch_variants(store, "batch"), sample=BATCH_SAMPLE)


class Server:
    """One server store: its groups of variants (timed, or counting round trips), the end-of-run
    checks and the clean-up."""

    name = ""
    url = ""
    port = 0
    driver = ""
    module = ""

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(self.driver) is None:
            return f"the {self.driver} driver is not installed"
        if importlib.util.find_spec(self.module) is None:
            return f"this oncely has no {self.module} yet"
        if not answers(self.url, self.port):
            return f"nothing answers at {oncely.redact(self.url)}"
        return None

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        raise NotImplementedError

    def check(self) -> None:
        """Verify the transactional books at the end (databases only)."""

    def version(self) -> str:
        return "?"

    def cleanup(self) -> None:
        raise NotImplementedError


TX_VARIANTS = ("raw", "marker", "own", "joined", "joined_sp")
TX_NAMES = {
    "raw": "raw",
    "marker": "raw + marker",
    "own": "oncely (own tx)",
    "joined": "oncely (tx=, savepoint=False)",
    "joined_sp": "oncely (tx=, savepoint=True)",
}


def marker_params(key: str, token: str) -> dict[str, Any]:
    """oncely's claim parameters for a transactional marker (status completed, no lease), for
    the hand-run "raw + marker" variant (PostgreSQL form; MariaDB binds bytes)."""
    return {
        "consumer": "tx-marker",
        "key": key,
        "status": "completed",
        "fingerprint": FP,
        "token": token,
        "lease": 0,
        "span": SPAN_MS,
        "error": None,
        "now": None,
    }


def check_books(
    store: str, variant: str, sent: int, rows: int, total: int, balance: int, markers: int
) -> None:
    """Exactly one ledger row, one balance increment and one marker per message sent."""
    if rows != sent or int(total) != sent * AMOUNT_CENTS or int(balance) != sent * AMOUNT_CENTS:
        raise BenchError(
            f"{store} tx {variant}: sent {sent}, ledger {rows} rows / {total}, balance {balance}"
        )
    if markers != sent:
        raise BenchError(f"{store} tx {variant}: sent {sent} but {markers} markers")


LEDGER_SQL = "INSERT INTO {ledger} (account_id, amount_cents, ref) VALUES (%s, %s, %s)"
BALANCE_SQL = "UPDATE {account} SET balance_cents = balance_cents + %s WHERE id = %s"
"""The business transaction's two statements (PostgreSQL and MariaDB alike), per variant's
tables: every variant books into a ledger and accounts of its own."""


class Database(Server):
    """A SQL server store (PostgreSQL, MariaDB): a table of the run's own for the store, a ledger
    and accounts per transactional variant, and how many messages each variant booked."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.table = f"bench_{RUN}"
        self.store_url = with_option(self.url, "table", self.table)
        self.sent = dict.fromkeys(TX_VARIANTS, 0)
        self.created = False

    def table_names(self) -> list[str]:
        """Every table the run created on this server, for the clean-up."""
        names = [self.table, f"{self.table}_meta"]
        for v in TX_VARIANTS:
            names += [f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"]
        return names

    def own_tx(
        self, store: Any, res: Resources, book: Callable[..., None], counted: bool
    ) -> Variant:
        """oncely beginning and committing its own transaction: ``handle_in_transaction(key,
        order, book)``; ``counted``: whether the messages count towards the books' check."""
        own_inbox = oncely.Inbox(store, consumer="tx-own")
        res.add(own_inbox.close)

        def tx_own_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                expect(own_inbox.handle_in_transaction(k, p, book), oncely.Outcome.PROCESSED)
            self.sent["own"] += len(msgs) if counted else 0

        return Variant(TX_NAMES["own"], tx_own_new)
