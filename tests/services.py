"""Real servers for tests: where each lives, and skip-or-fail when one does not answer.

Each service's address comes from an environment variable with the machine's default. When a
service does not answer, the test is skipped with the reason, unless ONCELY_REQUIRE_SERVICES=1
(set by .ci/run), in which case it fails: CI must never pass by skipping.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

REQUIRED = os.environ.get("ONCELY_REQUIRE_SERVICES") == "1"
DISRUPTIVE = os.environ.get("ONCELY_DISRUPTIVE_TESTS") == "1"

POSTGRES_DSN = os.environ.get(
    "ONCELY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("ONCELY_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
# Database 15, not 0: the model tests compare the store's stats() (a SCAN of the whole
# database) after every step, so a developer's own keys in database 0 would slow them down
# by the size of that keyspace.
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
RABBITMQ_URL = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("ONCELY_TEST_NATS_URL", "nats://127.0.0.1:4222")


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def require(name: str, url: str, default_port: int) -> None:
    """Skip (or, in CI, fail) the calling test unless ``url`` accepts connections."""
    if _answers(url, default_port):
        return
    reason = f"{name} does not answer at {url}; start it (see shared SERVICES.md) to run this test"
    if REQUIRED:
        pytest.fail(f"ONCELY_REQUIRE_SERVICES=1 and {reason}")
    pytest.skip(reason)


def disruptive(what: str) -> pytest.MarkDecorator:
    """Mark a test that stops or restarts a server other programs share (``what``): it runs
    only with ONCELY_DISRUPTIVE_TESTS=1 (set by .ci/run), never on somebody's laptop unasked."""
    return pytest.mark.skipif(
        not DISRUPTIVE,
        reason=f"{what}; set ONCELY_DISRUPTIVE_TESTS=1 to run it (it starts the server again)",
    )
