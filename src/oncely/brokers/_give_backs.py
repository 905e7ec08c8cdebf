"""What a consumer process counts apart from its broker's delivery count: the give-backs it
made of each unfinished message. JetStream's ``num_delivered``, a quorum queue's
``x-delivery-count``, SQS's ``ApproximateReceiveCount`` and a Redis Streams entry's delivery
counter also count a delivery given back unrun (a copy that met a running copy of its key,
the store away, a shutdown); ``max_deliveries`` counts failed runs, so those are taken off
the broker's count before it is compared with it. Shared by the consumer loop
(:mod:`oncely.brokers._consumer`) and the FastStream middleware."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["GIVE_BACKS_KEPT", "GiveBacks", "failed_reason"]

GIVE_BACKS_KEPT = 10_000
"""The most unfinished messages whose give-backs a consumer remembers (a forgotten one has its
later failures counted as before: every delivery of it a failure)."""


class GiveBacks:
    """How many times this process gave each unfinished message back unrun, by the message's
    identity on its broker (the same on each of its deliveries: a JetStream stream sequence,
    a Redis Streams entry id...). Noted only where the broker counts the give-back as a
    delivery. At most ``kept`` messages, the least recently given back forgotten first.

    A give-back made by another process, or before a restart, is not known here and counts
    as a failure: a message is dead-lettered sooner then, never retried beyond
    ``max_deliveries`` failures."""

    __slots__ = ("_kept", "_noted")

    def __init__(self, kept: int = GIVE_BACKS_KEPT) -> None:
        self._kept = kept
        self._noted: OrderedDict[Hashable, int] = OrderedDict()

    def note(self, identity: Hashable | None) -> None:
        """The message ``identity`` was given back unrun (``None``: nothing to note)."""
        if identity is None:
            return
        noted = self._noted
        noted[identity] = noted.pop(identity, 0) + 1
        if len(noted) > self._kept:
            noted.popitem(last=False)

    def failures(self, identity: Hashable | None, count: int) -> tuple[int, int]:
        """How many of the message's ``count`` deliveries (its broker's count, this one
        included) failed, and how many this process gave back unrun (never more than
        ``count - 1``: this delivery is a failure)."""
        if not self._noted or identity is None:
            return count, 0
        given = max(0, min(self._noted.get(identity, 0), count - 1))
        return count - given, given

    def forget(self, identity: Hashable | None) -> None:
        """The message is acknowledged or dead-lettered: its give-backs are forgotten."""
        if self._noted and identity is not None:
            self._noted.pop(identity, None)

    def __len__(self) -> int:
        return len(self._noted)


def failed_reason(failures: int, count: int, given_back: int, last: str) -> str:
    """The dead-letter reason of a message that failed ``max_deliveries`` times: how many
    failures among how many deliveries (``given_back`` of them given back unrun), and the
    last error."""
    if given_back:
        return (
            f"failed {failures} times in {count} deliveries ({given_back} given back unrun, "
            f"no failures: a copy running elsewhere, the store away); last: {last}"
        )
    return f"failed on all {count} deliveries; last: {last}"
