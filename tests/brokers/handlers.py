"""Handlers for ``oncely consume`` tests, imported by the command as ``module:function``.

Each effect is a line appended to the file named by ``ONCELY_TEST_EFFECTS`` (a file, so the
test process can read what the consumer process did)."""

from __future__ import annotations

import json
import os
from typing import Any

import oncely


async def record(payload: dict[str, Any]) -> dict[str, Any]:
    if payload.get("poison"):
        raise oncely.Reject("poison order")
    with open(os.environ["ONCELY_TEST_EFFECTS"], "a") as out:
        out.write(json.dumps(payload, sort_keys=True) + "\n")
    return {"recorded": payload.get("order")}


def not_async(payload: object) -> None:
    """A plain function: the command refuses it."""


async def unstorable(payload: dict[str, Any]) -> object:
    """Runs, and returns a result the inbox's JSON codec cannot store."""
    with open(os.environ["ONCELY_TEST_EFFECTS"], "a") as out:
        out.write(json.dumps(payload, sort_keys=True) + "\n")
    return {"an object": object()}


async def record_in(tx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """:func:`record` for the transactional mode (the effect file is written in the handler,
    the marker and any stored offset in ``tx``)."""
    return await record(payload)


def reconcile_by_key(stale: oncely.StaleClaim) -> oncely.Resolution:
    """A reconciler (a plain def: ``oncely consume`` runs it in a worker thread) that finds
    the effect of a ``sent-*`` key done and leaves any other for a person. Each question is
    a line in the effects file."""
    with open(os.environ["ONCELY_TEST_EFFECTS"], "a") as out:
        out.write(json.dumps({"asked": stale.record.key}) + "\n")
    if stale.record.key.startswith("sent-"):
        return oncely.Resolution.completed({"found": stale.record.key})
    return oncely.Resolution.escalate(f"no trace of {stale.record.key}")


def note_outcome(handled: oncely.Handled[Any]) -> None:
    """A metrics hook (``--hook``): each outcome, key and correlation id is a line in the file
    named by ``ONCELY_TEST_HOOKS``."""
    with open(os.environ["ONCELY_TEST_HOOKS"], "a") as out:
        line = [handled.outcome.value, handled.key, handled.correlation_id]
        out.write(json.dumps(line) + "\n")


def broken_hook(handled: oncely.Handled[Any]) -> None:
    """A hook whose exporter is down: it raises for every outcome."""
    raise RuntimeError("metrics exporter down")


async def book_in_dynamodb(tx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """The transactional mode on the DynamoDB store: one ledger item per application, under a
    fresh id (a second application of an order would show as a second item), buffered in the
    :class:`~oncely.stores.dynamodb.DynamoTransaction` that commits it with the marker. The
    ledger table is named by ``ONCELY_TEST_LEDGER``."""
    import uuid

    item = {"id": {"S": uuid.uuid4().hex}, "order": {"N": str(payload["order"])}}
    tx.put(os.environ["ONCELY_TEST_LEDGER"], item)
    return {"booked": payload["order"]}
