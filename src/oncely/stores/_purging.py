"""What the purge service's two runtimes share (:mod:`oncely.stores.async_purging`)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

from oncely.errors import ConfigurationError

__all__ = ["LOGGER", "PURGE_BATCH", "PURGE_PAUSE", "PurgeRun", "check_pause", "purge_options"]

LOGGER = logging.getLogger("oncely.purge")

PURGE_BATCH = 500
"""Records per purge batch, each a short transaction of its own. Measured with a consumer
process claiming beside a purge of 10% expired records (``bench/scale.py``, quiet and purging
slices interleaved): on PostgreSQL at 10^6 records, batches of 1,000 left the consumer's p99
at 2.3-2.5x its quiet p99, 500 at 1.75x (82,000 rows/s), 200 at 1.1-1.3x; at 10^7, 500 gave
55,000 rows/s at 0.95x and 200 43,000 rows/s at 1.4x."""

PURGE_PAUSE = 1.0
"""The rest after each purge batch, as a multiple of the batch's own time: the purge takes at
most half of the database's time, and a claim finds it between batches half the time."""


def check_pause(pause: float) -> None:
    """Refuse a pause that is not a number from 0 (no rest) to 100 (a multiple of the
    batch's time)."""
    if isinstance(pause, bool) or not isinstance(pause, int | float) or not 0 <= pause <= 100:
        raise ConfigurationError(
            f"the purge's pause is a multiple of each batch's time between 0 and 100, not {pause!r}"
        )


def purge_options(store: Any, **options: Any) -> dict[str, Any]:
    """``options`` for ``store.purge_expired``, less the optional ones it does not take:
    oncely's stores take ``on_batch`` and ``pause`` (where they batch), a third party's store
    may take only the protocol's ``batch_size`` and ``max_batches``."""
    takes = inspect.signature(store.purge_expired).parameters
    return {
        name: value
        for name, value in options.items()
        if name in takes or name in ("batch_size", "max_batches")
    }


@dataclass(frozen=True, slots=True)
class PurgeRun:
    """One run of a purge service: whether it led (another process may), the records it
    deleted, the batches it took and how long it took."""

    leader: bool
    deleted: int
    batches: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.deleted / self.seconds if self.seconds > 0 else 0.0


class _Stopped(Exception):
    """Raised from a batch's report to end a run that was asked to stop."""
