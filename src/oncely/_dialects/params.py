"""Statement parameters shared by the SQL dialects' named-parameter statements."""

from __future__ import annotations

from oncely._core.records import Status

__all__ = ["scan_params"]


def scan_params(
    now: int | None,
    consumer: str | None,
    status: Status | None,
    after: tuple[str, str] | None,
    limit: int,
) -> dict[str, object]:
    """The parameters of a ``scan`` statement: unexpired records in ``(consumer, key)`` order
    after ``after`` (from the start when ``None``), optionally of one consumer and status.
    ``now`` is ``None`` where the statement reads the server's clock."""
    after_consumer, after_key = after if after is not None else ("", "")
    return {
        "now": now,
        "consumer": consumer,
        "status": status.value if status is not None else None,
        "after_consumer": after_consumer,
        "after_key": after_key,
        "limit": limit,
    }
