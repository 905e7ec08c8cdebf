"""The demo's workload: payments, and a seeded plan of every duplicate source to inject (R1).

One :class:`Workload` is built from a seed and fed, unchanged, to each consumer. It holds the
*copies* the producer publishes, in publication order, and the fault each copy carries:

==================  =====================================================================
origin / fault      what the demo does with it
==================  =====================================================================
``producer_retry``  the producer publishes the same message (same id, same body) twice
``reused_key``      the producer publishes another body under an id already used (R20.6)
``lose_ack``        the broker drops the first acknowledgement of the copy and redelivers it
                    after the visibility timeout
``kill``            the worker handling the first delivery is killed with SIGKILL after its
                    writes and before its acknowledgement
``slow``            the first delivery's handler runs past the visibility timeout, so the
                    broker hands the copy to another worker while the first still runs
``twin``            the broker hands the first delivery to two workers at the same moment
==================  =====================================================================

Each fault lands on a different logical message, so every count in the report has one cause.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Literal

from oncely.testing.file_broker import Published

__all__ = ["Copy", "FaultCounts", "Origin", "Payment", "WorkerFault", "Workload"]

Origin = Literal["original", "producer_retry", "reused_key"]
WorkerFault = Literal["lose_ack", "kill", "slow", "twin"]

ACCOUNTS = 20
_FAULTS: dict[str, WorkerFault] = {
    "lose_ack": "lose_ack",
    "kill": "kill",
    "slow": "slow",
    "twin": "twin",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Payment:
    """The body of a message: move ``amount`` cents into ``account``."""

    account: str
    amount: int

    def to_json(self) -> dict[str, object]:
        return {"account": self.account, "amount": self.amount}


@dataclass(frozen=True, slots=True, kw_only=True)
class Copy:
    """One message as the producer publishes it: the producer-assigned ``message_id`` is the
    dedup key (R2, R20 step 1); several copies may share it."""

    message_id: str
    payment: Payment
    origin: Origin
    fault: WorkerFault | None = None

    def published(self) -> Published:
        """This copy as the test broker stores it (the payment as JSON)."""
        body = json.dumps(self.payment.to_json()).encode()
        return Published(self.message_id, body, self.origin, self.fault)


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultCounts:
    """How many logical messages receive each injected duplicate source."""

    producer_retries: int
    lost_acks: int
    kills: int
    slow_handlers: int
    twins: int
    reused_keys: int

    @classmethod
    def for_messages(cls, messages: int) -> FaultCounts:
        """Counts that scale with the workload. Kills and slow handlers are capped at three
        each: every one costs a visibility timeout (and a kill a process start) of wall time."""
        return cls(
            producer_retries=max(1, round(messages * 0.04)),
            lost_acks=max(1, round(messages * 0.02)),
            kills=max(1, min(3, messages // 150)),
            slow_handlers=max(1, min(3, messages // 200)),
            twins=max(1, round(messages * 0.02)),
            reused_keys=max(1, round(messages * 0.01)),
        )

    @property
    def total(self) -> int:
        return (
            self.producer_retries
            + self.lost_acks
            + self.kills
            + self.slow_handlers
            + self.twins
            + self.reused_keys
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """The copies to publish, in order, and the counts they were built from."""

    messages: int
    seed: int
    faults: FaultCounts
    copies: tuple[Copy, ...]

    @classmethod
    def build(cls, *, messages: int, seed: int) -> Workload:
        """The same ``(messages, seed)`` always gives the same copies, faults and order.

        Needs at least as many messages as there are faults to place (about a dozen)."""
        faults = FaultCounts.for_messages(messages)
        if faults.total > messages:
            raise ValueError(
                f"{messages} messages cannot carry the {faults.total} injected faults; "
                "use at least 12 messages"
            )
        rng = random.Random(seed)
        ids = [f"payment-{i:05d}" for i in range(1, messages + 1)]
        payments = {
            message_id: Payment(
                account=f"acct-{rng.randrange(ACCOUNTS):02d}", amount=rng.randint(100, 50_000)
            )
            for message_id in ids
        }
        # Slow handlers and kills each hold a worker for a second or more: spread them over the
        # queue (one per stretch, slow ones early in their stretch, kills late) so they seldom
        # hold every worker at once.
        plan: dict[str, str] = {}
        for name, count, lo, hi in (("slow", faults.slow_handlers, 0.1, 0.4),
                                    ("kill", faults.kills, 0.6, 0.9)):  # fmt: skip
            stretch = messages / count
            for j in range(count):
                first = int(j * stretch + lo * stretch)
                last = max(first, int(j * stretch + hi * stretch) - 1)
                plan[ids[rng.randint(first, last)]] = name
        rest = [message_id for message_id in ids if message_id not in plan]
        chosen = rng.sample(rest, faults.total - len(plan))
        start = 0
        for name, count in (
            ("producer_retry", faults.producer_retries),
            ("lose_ack", faults.lost_acks),
            ("twin", faults.twins),
            ("reused_key", faults.reused_keys),
        ):
            for message_id in chosen[start : start + count]:
                plan[message_id] = name
            start += count
        # Each copy gets a position on the publication timeline: a producer retry follows its
        # original closely, a reused id comes back much later with a changed amount.
        placed: list[tuple[float, int, Copy]] = []
        for index, message_id in enumerate(ids):
            payment = payments[message_id]
            kind = plan.get(message_id)
            fault = _FAULTS.get(kind or "")
            placed.append(
                (float(index), len(placed), Copy(message_id=message_id, payment=payment,
                                                  origin="original", fault=fault))
            )  # fmt: skip
            if kind == "producer_retry":
                at = index + rng.uniform(0.1, 3.0)
                retry = Copy(message_id=message_id, payment=payment, origin="producer_retry")
                placed.append((at, len(placed), retry))
            elif kind == "reused_key":
                at = index + rng.uniform(5.0, max(6.0, messages / 4))
                changed = Payment(
                    account=payment.account, amount=payment.amount + rng.randint(1, 999)
                )
                placed.append(
                    (at, len(placed), Copy(message_id=message_id, payment=changed,
                                           origin="reused_key"))
                )  # fmt: skip
        placed.sort(key=lambda item: (item[0], item[1]))
        return cls(messages, seed, faults, tuple(copy for _, _, copy in placed))
