from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import redis_cluster
from tests.backends import Scope


@pytest.fixture(autouse=True)
def _quiet_oncely_logs(caplog: pytest.LogCaptureFixture) -> None:
    # Outcome logs are captured (and asserted on where it matters) rather than printed.
    caplog.set_level(logging.INFO, logger="oncely")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the Redis Cluster the tests started (if any) as soon as the run ends, not at exit.
    import sys

    started = sys.modules.get("tests.redis_cluster")
    if started is not None:
        started.shutdown()


@pytest.fixture
def private_redis() -> Iterator[tuple[Any, str]]:
    """A Redis of the test's own (its settings, such as its memory policy, are the test's to
    change): a client and its URL. Skips without ``redis-server``."""
    import redis

    try:
        with redis_cluster.private_server() as port:
            client = redis.Redis(port=port)
            try:
                yield client, f"redis://127.0.0.1:{port}/0"
            finally:
                client.close()
    except redis_cluster.ClusterUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def scope(tmp_path: Path) -> Iterator[Scope]:
    """Names of a test's own (a unique suffix) and what to clean up after it, for the
    backends of ``tests.backends``."""
    made = Scope(tmp_path=tmp_path, unique=uuid.uuid4().hex[:12])
    try:
        yield made
    finally:
        for finalizer in reversed(made.finalizers):
            finalizer()
