"""What the purge service's two runtimes share (:mod:`oncely.stores.async_purging`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["LOGGER", "PurgeRun"]

LOGGER = logging.getLogger("oncely.purge")


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
