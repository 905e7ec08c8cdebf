"""Constants and helpers shared by the Redis store test modules."""

from __future__ import annotations

import pytest

from tests.backends.redis_cluster import require_cluster

LEASE_MS = 30_000
KEEP_MS = 86_400_000


def _charge(payload: object) -> dict[str, object]:
    return {"charged": payload}


def _url_for(where: str, request: pytest.FixtureRequest) -> str:
    if where == "redis":
        return str(request.getfixturevalue("redis_url"))
    return require_cluster().url
