"""What the task integrations (Celery, Dramatiq, taskiq) share about a message that cannot
run now or should not run again: how long a copy that met a running one waits before it is
sent again, and when runs that never finished have spent the message's retries.

A run that dies with the whole worker (a solo or threads pool calling ``os._exit``, the OOM
killer taking the worker) raises nothing the framework sees: the broker gives the message to
the next worker, which dies again, for ever. What counts those runs is the inbox: the dead run
left the key in progress, and the next claim takes it over once its lease lapsed, one attempt
higher each time (a release, after a run that raised, deletes the record: the count starts
again). So a claim won as attempt ``n`` comes after ``n - 1`` runs in a row that never
finished."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from oncely._core.outcomes import Handled
from oncely._core.records import Status
from oncely.inbox.sync_inbox import Claimed

__all__ = [
    "IN_FLIGHT_RESENDS",
    "give_up",
    "in_flight_delay",
    "resends_of",
    "unfinished",
    "unfinished_reason",
]

IN_FLIGHT_RESENDS = "oncely_in_flight"
"""The header (Celery), message option (Dramatiq) or label (taskiq) counting how often a
message was sent again because its key was being processed elsewhere: the step of its
backoff."""

_STORE_AWAY_AT_MOST = 30.0
"""The longest wait between two tries of a copy whose claim got no answer (the store away):
the default lease, since no record says how long the key could be held."""
_HOLD_AT_MOST = 300.0
"""The longest wait in one go (a broker closes a consumer that holds a message unacknowledged
for much longer: RabbitMQ after 30 min; Celery holds a countdown's message unacknowledged,
and oncely's taskiq receiver holds the copy while it waits)."""


def in_flight_delay(
    first: float, resends: int, handled: Handled[Any] | None, at_most: float | None = None
) -> float:
    """Seconds before a copy that met its key in progress (or a store that did not answer) is
    tried again: ``first`` the first time, then twice as long each time (``resends``: how often
    it was sent again before), up to what is left of the lease the key is held under (the
    earliest moment the holder, if it died, can be taken over), never less than ``first``.
    A fixed delay sent a copy of an hour-long task again 1,800 times in that hour.
    ``at_most``, when given, bounds every wait, ``first`` included: the longest a broker lets
    a message be held unacknowledged before it hands it out again (Celery's Redis broker)."""
    grown = first * 2.0 ** min(max(resends, 0), 32)
    record = handled.record if handled is not None else None
    if record is not None and record.status is Status.IN_PROGRESS:
        cap = (record.lease_until_ms - time.time() * 1000 + 100) / 1000
    else:
        cap = _STORE_AWAY_AT_MOST
    delay = max(first, min(grown, cap, _HOLD_AT_MOST))
    return delay if at_most is None else min(delay, at_most)


def resends_of(value: object) -> int:
    """The in-flight resend count a message carries (0 when it carries none, or garbage)."""
    try:
        return max(int(value), 0) if value is not None else 0  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def unfinished(attempt: int, limit: int | None) -> int | None:
    """How many runs in a row never finished before the claim won as ``attempt``, when they
    are more than the ``limit`` of retries the task allows (None: run it)."""
    runs = attempt - 1
    if limit is None or runs <= limit:
        return None
    return runs


def unfinished_reason(runs: int) -> str:
    """Why a message is dead-lettered after ``runs`` runs that never finished."""
    return (
        f"failed on all {runs} deliveries; last: none of its {runs} runs finished (the worker "
        "running it died: killed, out of memory, os._exit; or it lost its claim mid-run), "
        "so it is not run again"
    )


def give_up(
    claimed: Claimed[Any], runs: int, send: Callable[[str], Any], sent: type[BaseException]
) -> Any:
    """Dead-letter, with ``send(reason)``, a message whose last ``runs`` runs never finished,
    instead of running it again (Celery, Dramatiq; ``send`` raises ``sent`` once the letter
    is out). The claim is released once the letter is sent (a copy sent on purpose later runs
    afresh); if the letter cannot be sent, the key is marked rejected, so the copy the broker
    gives again is dead-lettered, never run."""
    reason = unfinished_reason(runs)
    try:
        return send(reason)
    except sent:
        claimed.release(reason)
        raise
    except Exception:
        with contextlib.suppress(Exception):  # else its lease lapses: the next copy's
            claimed.reject(reason)  # claim is one attempt higher, and gives up too
        raise
