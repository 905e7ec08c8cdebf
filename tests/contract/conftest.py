from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends import BACKENDS, Backend, Scope


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen = BACKENDS[str(request.param)]
    chosen.require()
    return chosen


@pytest.fixture
def scope(tmp_path: Path) -> Iterator[Scope]:
    made = Scope(tmp_path=tmp_path, unique=uuid.uuid4().hex[:12])
    try:
        yield made
    finally:
        for finalizer in reversed(made.finalizers):
            finalizer()
