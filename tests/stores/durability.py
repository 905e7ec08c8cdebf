"""What the tests of a SQL store on a server that may lose the commits it confirmed share
(``mysql/test_durability.py``, ``postgres/test_durability.py``): what the store says at
WARNING, on the ``oncely.store`` logger, as it is set up."""

from __future__ import annotations

import logging

import pytest

import oncely
from oncely.stores import Claim

LONG = 3_600_000
"""A lease and a keep (ms) that no test outlives."""


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the ``oncely.store`` logger said."""
    return [r.getMessage() for r in caplog.records if r.name == "oncely.store"]


def claim(store: oncely.Store, key: str) -> Claim:
    """A claim of ``key`` (consumer ``c``) for :data:`LONG`: the first sets the store up."""
    return store.claim("c", key, fingerprint=None, token="t", lease_ms=LONG, keep_ms=LONG,
                       takeover=False)  # fmt: skip


def said_while_set_up(store: oncely.Store, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What ``store`` says at WARNING (or above) while it is set up; closed afterwards."""
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            store.prepare()  # type: ignore[attr-defined]
    finally:
        store.close()
    return said(caplog)
