"""The rules a store executes, for store authors (R8-R10, R13).

Every oncely store asks the same state machine (:mod:`oncely._core.state`) what a claim, a
fenced write or a purge does to a record; none re-implements it. A store that keeps its
records somewhere oncely does not know can run the rules the same way: read the record, ask,
write what comes back, all under its own lock or transaction. :class:`RecordTable` runs them
on records in memory (it is what :class:`~oncely.MemoryStore` wraps, and the reference model
the contract suite compares stores with); the events are the arguments of each operation.
"""

from oncely._core.state import (
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    claim_event,
)
from oncely._core.table import RecordTable

__all__ = [
    "ClaimEvent",
    "CompleteEvent",
    "FailEvent",
    "RecordTable",
    "ReleaseEvent",
    "RenewEvent",
    "TakeoverEvent",
    "claim_event",
]
