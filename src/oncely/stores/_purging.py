"""What the purge service's two runtimes share (:mod:`oncely.stores.async_purging`)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

from oncely.errors import ConfigurationError

__all__ = ["LOGGER", "PURGE_BATCH", "PURGE_PAUSE", "PurgeRun", "check_pause", "purge_options"]

LOGGER = logging.getLogger("oncely.purge")

PURGE_BATCH = 200
"""Records per purge batch, each a short transaction of its own. Measured with a consumer
claiming beside a purge of 10^5 expired among 10^6 (``bench/scale.py``): at 1,000 a batch the
consumer's p99 was 2.3-2.5x its quiet p99 on PostgreSQL, at 200 1.1-1.3x, the purge still over
50,000 rows/s; on MariaDB 1.2x at 200."""

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
