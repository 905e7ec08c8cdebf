"""The DynamoDB store on moto's server (``moto_server``, from the dev extras), started once per
test session on a free loopback port (as the SQS tests start theirs), or on the endpoint
``ONCELY_TEST_DYNAMODB_URL`` names (``http://HOST:PORT``). Each test has a table of its own,
deleted afterwards."""

from __future__ import annotations

import contextlib
import os
import threading
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


def _require() -> None:
    """Start moto's server (or skip, or in CI fail, without one)."""
    endpoint()


def _sync(scope: Scope, clock: FakeClock | None) -> oncely.Store:
    return oncely.open(store_url(scope), clock=clock)


def _async(scope: Scope, clock: FakeClock | None) -> oncely.AsyncStore:
    return oncely.open_async(store_url(scope), clock=clock)


BACKEND = Backend(
    name="dynamodb",
    make_sync=_sync,
    make_async=_async,
    require=_require,
)
