from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_oncely_logs(caplog: pytest.LogCaptureFixture) -> None:
    # Outcome logs are captured (and asserted on where it matters) rather than printed.
    caplog.set_level(logging.INFO, logger="oncely")
