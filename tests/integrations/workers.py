"""What the end-to-end tests of the worker integrations (Dramatiq, FastStream) share: waiting
for the workers' effects in Redis, and the inbox's store as a fixture (SQLite and Redis)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.services import RABBITMQ_URL, REDIS_URL, require


def until(
    check: Callable[[], bool], seconds: float = 60, client: redis.Redis | None = None, ns: str = ""
) -> None:
    """Wait for ``check``; on a timeout, fail with the effects under ``ns`` in Redis."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            seen = {} if client is None else {
                k.decode(): client.get(k) for k in client.scan_iter(match=f"{ns}:*")
            }  # fmt: skip
            pytest.fail(f"the workers did not get there in time: {seen}")
        time.sleep(0.2)


def store_url(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[str]:
    """The inbox's store for a worker test (``request.param``: sqlite or redis), its keys
    removed afterwards; RabbitMQ and Redis required."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'inbox.db'}"
        return
    unique = f"{prefix}_{uuid.uuid4().hex[:8]}"
    yield f"{REDIS_URL}?prefix={unique}"
    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"{unique}*"):
        client.delete(name)
    client.close()
