from __future__ import annotations

import logging

import pytest


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
