"""What the task integrations (Celery, Dramatiq) share about a message that should not run
again: when runs that never finished have spent the message's retries.

A run that dies with the whole worker (a solo or threads pool calling ``os._exit``, the OOM
killer taking the worker) raises nothing the framework sees: the broker gives the message to
the next worker, which dies again, for ever. What counts those runs is the inbox: the dead run
left the key in progress, and the next claim takes it over once its lease lapsed, one attempt
higher each time (a release, after a run that raised, deletes the record: the count starts
again). So a claim won as attempt ``n`` comes after ``n - 1`` runs in a row that never
finished."""

from __future__ import annotations

__all__ = ["unfinished", "unfinished_reason"]


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
