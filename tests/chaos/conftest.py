"""Fixtures for the chaos tests: child processes that never outlive their test."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from tests.chaos.harness import Processes


@pytest.fixture
def procs() -> Iterator[Processes]:
    processes = Processes()
    try:
        yield processes
    finally:
        processes.reap()


@pytest.fixture
def parent_pid() -> int:
    """The pid children watch: when it changes, the test run died and they exit too."""
    return os.getpid()


@pytest.fixture
def chaos_seed() -> int:
    """The seed of a test's random choices (key orders, kill schedule): ONCELY_CHAOS_SEED if
    set, to replay a run, else a fresh one. Every report prints it."""
    return int(os.environ.get("ONCELY_CHAOS_SEED", random.randrange(2**32)))
