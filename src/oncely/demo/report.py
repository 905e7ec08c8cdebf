"""What happened to each consumer, read from the databases after the run (ground truth).

Every number comes from the broker's tables (copies, deliveries, kills) and from the consumer's
effect ledger, never from a counter a consumer keeps. Definitions (a *logical message* is one
producer message id; its copies share the id):

``logical_messages``
    Distinct message ids published.
``copies_published``
    Copies the producer published (originals, producer retries, reused ids).
``deliveries``
    Hand-outs of a copy to a worker, every kind (first, redelivery after a lease ran out,
    requeue, twin).
``duplicates_delivered``
    Deliveries of a logical message after its first one: ``deliveries`` minus the number of
    logical messages delivered at least once.
``effects``
    Rows in the consumer's payments ledger (naive and transactional: the ledger table; two-phase:
    the external provider's payments).
``extra_effects``
    Effects beyond one per logical message: the sum over message ids of ``max(0, effects - 1)``.
    A reused id with changed content should have one effect (the other copy is dead-lettered),
    so its second effect counts as extra too.
``key_conflicts_dead_lettered``
    Logical messages with at least one copy dead-lettered because the consumer found its id
    reused for different content (outcome ``key_conflict``, R20 step 6).
``dead_lettered`` / ``parked``
    Copies the broker holds dead-lettered (for any reason) / parked for a person.
``lost``
    Logical messages with no effect and no copy dead-lettered or parked: dropped silently.
``unsettled``
    Copies still ready or leased when the run ended (zero unless the run hit its deadline).
``balances_consistent``
    Every account balance equals the sum of its ledger rows (no half-applied effect).
``reconciled``
    Two-phase only: oncely records that the ``on_stale`` reconciler completed from the
    provider's payments (the note oncely writes on such a record) instead of charging again.
``worker_crashes``
    Workers that died without being asked to (the runner's own SIGKILLs do not count).
``outcomes``
    Deliveries per outcome the consumer handed to the broker with its settlement; the one
    figure that comes from the consumer, for information only. ``not_settled``: the worker was
    killed before settling.

Evidence that each injected duplicate source happened (``injected``), from the broker:
``producer_retries_delivered`` (second copies delivered), ``acks_lost`` (acks the broker dropped,
followed by a redelivery), ``workers_killed`` (SIGKILLs with exit code -9, followed by a
redelivery), ``expired_locks`` (redeliveries after a lease ran out while the previous holder was
still running: it settled after the new delivery began), ``twin_deliveries`` (second halves of a
copy handed to two workers at once) and ``reused_keys_delivered``.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from oncely.testing.file_broker import FileBroker

if TYPE_CHECKING:
    from rich.console import Console

    from oncely.demo.run import DemoOptions

__all__ = ["ConsumerReport", "DemoReport", "Injected", "measure"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Injected:
    """FileBroker-side evidence of each duplicate source (see the module docstring)."""

    producer_retries_delivered: int
    acks_lost: int
    workers_killed: int
    expired_locks: int
    twin_deliveries: int
    reused_keys_delivered: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerReport:
    """One consumer's run. Field meanings: the module docstring."""

    consumer: str
    logical_messages: int
    copies_published: int
    deliveries: int
    duplicates_delivered: int
    effects: int
    extra_effects: int
    key_conflicts_dead_lettered: int
    dead_lettered: int
    parked: int
    lost: int
    unsettled: int
    balances_consistent: bool
    reconciled: int
    worker_crashes: int
    injected: Injected
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        del data["consumer"]
        return data


def _count(broker: FileBroker, sql: str) -> int:
    return int(broker.read(sql)[0][0] or 0)


def measure(
    consumer: str,
    broker: FileBroker,
    effects: dict[str, int],
    *,
    balances_consistent: bool,
    reconciled: int,
    worker_crashes: int,
    seconds: float,
) -> ConsumerReport:
    """The report of one run from its broker file and its effects per message id."""
    ids = {str(r[0]) for r in broker.read("SELECT DISTINCT message_id FROM copies")}
    deliveries = _count(broker, "SELECT count(*) FROM deliveries")
    delivered_ids = _count(broker, "SELECT count(DISTINCT message_id) FROM deliveries")
    settled_out = {
        str(r[0])
        for r in broker.read("SELECT message_id FROM copies WHERE state IN ('dead', 'parked')")
    }
    conflicts = _count(
        broker,
        "SELECT count(DISTINCT message_id) FROM copies "
        "WHERE state = 'dead' AND reason LIKE 'key_conflict:%'",
    )
    outcomes = {
        str(outcome): int(n)
        for outcome, n in broker.read(
            "SELECT coalesce(outcome, 'not_settled'), count(*) FROM deliveries "
            "GROUP BY 1 ORDER BY 2 DESC"
        )
    }
    redelivered = "EXISTS (SELECT 1 FROM deliveries r WHERE r.seq = {0}.seq AND r.id > {1})"
    injected = Injected(
        producer_retries_delivered=_count(
            broker, "SELECT count(*) FROM copies WHERE origin = 'producer_retry' AND deliveries > 0"
        ),
        acks_lost=_count(
            broker,
            "SELECT count(*) FROM deliveries d WHERE result = 'ack_lost' AND "
            + redelivered.format("d", "d.id"),
        ),
        workers_killed=_count(
            broker,
            f"SELECT count(*) FROM kills k WHERE exitcode = {-signal.SIGKILL} AND "
            + redelivered.format("k", "k.delivery_id"),
        ),
        expired_locks=_count(
            broker,
            """SELECT count(*) FROM deliveries r WHERE r.cause = 'lease_expired' AND EXISTS (
                SELECT 1 FROM deliveries d WHERE d.seq = r.seq AND d.id < r.id
                    AND d.settled_ms >= r.delivered_ms)""",
        ),
        twin_deliveries=_count(broker, "SELECT count(*) FROM deliveries WHERE cause = 'twin'"),
        reused_keys_delivered=_count(
            broker, "SELECT count(*) FROM copies WHERE origin = 'reused_key' AND deliveries > 0"
        ),
    )
    return ConsumerReport(
        consumer=consumer,
        logical_messages=len(ids),
        copies_published=_count(broker, "SELECT count(*) FROM copies"),
        deliveries=deliveries,
        duplicates_delivered=deliveries - delivered_ids,
        effects=sum(effects.values()),
        extra_effects=sum(max(0, n - 1) for n in effects.values()),
        key_conflicts_dead_lettered=conflicts,
        dead_lettered=_count(broker, "SELECT count(*) FROM copies WHERE state = 'dead'"),
        parked=_count(broker, "SELECT count(*) FROM copies WHERE state = 'parked'"),
        lost=sum(1 for i in ids if effects.get(i, 0) == 0 and i not in settled_out),
        unsettled=_count(broker, "SELECT count(*) FROM copies WHERE state IN ('ready', 'leased')"),
        balances_consistent=balances_consistent,
        reconciled=reconciled,
        worker_crashes=worker_crashes,
        injected=injected,
        outcomes=outcomes,
        seconds=round(seconds, 2),
    )


@dataclass(frozen=True, slots=True)
class DemoReport:
    """The reports of every consumer of one demo run, keyed by consumer name."""

    options: DemoOptions
    run_id: str
    consumers: dict[str, ConsumerReport]
    workdir: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, dict[str, object]]:
        """``{consumer name: {metric: value}}``; the top-level keys are exactly the consumer
        names. Each value holds every field of :class:`ConsumerReport` (see the module
        docstring), ``injected`` and ``outcomes`` as nested dicts."""
        return {name: report.to_dict() for name, report in self.consumers.items()}

    def render(self, console: Console) -> None:
        """Print the comparison table and a verdict per consumer."""
        from oncely.demo.render import render  # noqa: PLC0415 - imports rich only to print

        render(self, console)
