from __future__ import annotations

import pytest

from tests.backends import BACKENDS, Backend


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen = BACKENDS[str(request.param)]
    chosen.require()
    return chosen
