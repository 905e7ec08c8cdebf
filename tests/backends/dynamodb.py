"""The DynamoDB store on moto's server (``moto_server``, from the dev extras), started once per
test session on a free loopback port (as the SQS tests start theirs), or on the endpoint
``ONCELY_TEST_DYNAMODB_URL`` names (``http://HOST:PORT``). Each test has a table of its own,
deleted afterwards, and for the transactional tests a ledger table beside it, deleted too."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from typing import Any

import oncely
from oncely import FakeClock

from . import Backend, Scope

_GIVEN = os.environ.get("ONCELY_TEST_DYNAMODB_URL")
_started: dict[str, str] = {}
_lock = threading.Lock()


def endpoint() -> str:
    """``HOST:PORT`` of the test endpoint, starting moto's server on first use; skips (or, in
    CI, fails) when there is none."""
    if _GIVEN:
        return _GIVEN.split("://", 1)[-1].rstrip("/")
    with _lock:
        if "endpoint" not in _started:
            from tests.brokers.sqs_broker import _start_moto

            _started["endpoint"] = _start_moto()[0].split("://", 1)[1]
        return _started["endpoint"]


def table_name(scope: Scope) -> str:
    return f"oncely_dynamo_{scope.unique}"


def store_url(scope: Scope, **options: str) -> str:
    """The ``dynamodb://`` URL of the test's own table (deleted after the test)."""
    table = table_name(scope)
    scope.finalizers.append(lambda: drop_table(table))  # once or more: harmless
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return f"dynamodb://{endpoint()}/{table}" + (f"?{query}" if query else "")


def client() -> Any:
    """A botocore DynamoDB client on the test endpoint."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "dynamodb",
        endpoint_url=f"http://{endpoint()}",
        region_name="us-east-1",
        aws_access_key_id="oncely",
        aws_secret_access_key="oncely",
    )


def drop_table(table: str) -> None:
    c = client()
    try:
        with contextlib.suppress(c.exceptions.ResourceNotFoundException):
            c.delete_table(TableName=table)
    finally:
        c.close()


def create_ledger(table: str, key: str) -> None:
    """Create ``table``, a ledger without unique keys: partition key ``key`` and a sort key
    ``sk`` the writer draws at random, so that two writes of one key are two items."""
    c = client()
    try:
        c.create_table(
            TableName=table,
            AttributeDefinitions=[
                {"AttributeName": key, "AttributeType": "S"},
                {"AttributeName": "sk", "AttributeType": "S"},
            ],
            KeySchema=[
                {"AttributeName": key, "KeyType": "HASH"},
                {"AttributeName": "sk", "KeyType": "RANGE"},
            ],
            BillingMode="PAY_PER_REQUEST",
        )
    finally:
        c.close()


def _require() -> None:
    """Start moto's server (or skip, or in CI fail, without one)."""
    endpoint()


def _sync(scope: Scope, clock: FakeClock | None) -> oncely.Store:
    return oncely.open(store_url(scope), clock=clock)


def _async(scope: Scope, clock: FakeClock | None) -> oncely.AsyncStore:
    return oncely.open_async(store_url(scope), clock=clock)


class DynamoDBLedger:
    """A ledger without unique keys: one item per write (the key, and a random sort key), so
    that a double application shows as two items. Written through the transaction's ``put``,
    counted by a strongly consistent ``Query``."""

    def __init__(self, scope: Scope, store: object) -> None:
        self.table = f"oncely_ledger_{scope.unique}"
        scope.finalizers.append(lambda: drop_table(self.table))
        create_ledger(self.table, "key")

    def put(self, tx: Any, key: str, amount: int) -> None:
        tx.put(
            self.table,
            {"key": {"S": key}, "sk": {"S": uuid.uuid4().hex}, "amount": {"N": str(amount)}},
        )

    def count(self, key: str) -> int:
        c = client()
        try:
            found = c.query(
                TableName=self.table,
                KeyConditionExpression="#k = :k",
                ExpressionAttributeNames={"#k": "key"},
                ExpressionAttributeValues={":k": {"S": key}},
                ConsistentRead=True,
                Select="COUNT",
            )
        finally:
            c.close()
        return int(found["Count"])


class SyncDynamoDBLedger(DynamoDBLedger):
    def write(self, tx: Any, key: str, amount: int) -> None:
        self.put(tx, key, amount)


class AsyncDynamoDBLedger(DynamoDBLedger):
    async def write(self, tx: Any, key: str, amount: int) -> None:
        self.put(tx, key, amount)

    async def count(self, key: str) -> int:  # type: ignore[override]
        return super().count(key)


BACKEND = Backend(
    name="dynamodb",
    make_sync=_sync,
    make_async=_async,
    sync_ledger=SyncDynamoDBLedger,
    async_ledger=AsyncDynamoDBLedger,
    require=_require,
)
