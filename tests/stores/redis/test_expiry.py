"""Expiry on Redis's own clock (Redis deletes records itself) and on a given clock (the
clock decides, Redis never expires early, the purge removes)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
import redis

import oncely
from oncely import FakeClock, Status
from oncely._core.records import ClaimRequest
from oncely.stores import ClaimStatus
from oncely.stores.redis.dialect import RedisKeys
from oncely.stores.redis.sync_store import RedisStore
from tests.stores.redis.helpers import KEEP_MS, LEASE_MS

# ----------------------------------------------------------------------------- expiry


@pytest.mark.services
@pytest.mark.timeout(30)
def test_r13_on_the_servers_clock_redis_expires_records_itself(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client, prefix=prefix)
    name = RedisKeys(prefix).record("billing", "k")
    claim = store.claim(
        "billing", "k", fingerprint=None, token="t", lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=False,
    )  # fmt: skip
    assert client.pexpiretime(name) == claim.record.expires_ms
    assert abs(claim.now_ms - _server_ms(client)) < 60_000  # Redis's clock, not a fake one
    done = store.complete("billing", "k", token="t", result=b"r", keep_ms=200)
    assert client.pexpiretime(name) == done.expires_ms == done.updated_ms + 200
    while client.exists(name):  # Redis deletes it by itself (the test's timeout bounds this)
        time.sleep(0.05)
    assert store.get("billing", "k") is None
    assert store.purge_expired() == 0  # nothing is ever left for a sweeper
    client.close()


@pytest.mark.services
@pytest.mark.timeout(30)
def test_r13_a_batch_claim_writes_records_redis_expires_at_their_expiry(
    redis_url: str, prefix: str
) -> None:
    """A batch claim writes each free key with one command; every record still carries its
    Redis expiry, exactly at its ``expires``, and reads back whole."""
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client, prefix=prefix)
    keys = RedisKeys(prefix)
    requests = [
        ClaimRequest("a", "f 1\n\u00e9", "t 1"),
        ClaimRequest("b:{x}%", None, "t\n2"),
        ClaimRequest("c", "", "t3"),
    ]
    claims = store.claim_many("billing", requests, lease_ms=100, keep_ms=300, takeover=False)
    assert [c.status for c in claims] == [ClaimStatus.NEW] * 3
    for request, claim in zip(requests, claims, strict=True):
        name = keys.record("billing", request.key)
        assert client.pexpiretime(name) == claim.record.expires_ms == claim.now_ms + 300
        assert store.get("billing", request.key) == claim.record
        assert claim.record.fingerprint == request.fingerprint
    assert store.scan(consumer="billing") == sorted((c.record for c in claims), key=_key_of)
    assert store.stats().counts == {"billing": {Status.IN_PROGRESS: 3}}
    while any(client.exists(keys.record("billing", r.key)) for r in requests):
        time.sleep(0.05)  # Redis deletes them by itself (the test's timeout bounds this)
    again = store.claim_many("billing", requests, lease_ms=100, keep_ms=300, takeover=False)
    assert [c.status for c in again] == [ClaimStatus.NEW] * 3
    client.close()


def _key_of(record: oncely.Record) -> str:
    return record.key


@pytest.mark.services
@pytest.mark.parametrize("takeover", [False, True])
def test_r13_a_batch_claim_on_a_given_clock_replaces_expired_records(
    redis_url: str, prefix: str, takeover: bool
) -> None:
    """Redis keeps a given clock's expired records; a batch claim treats them as absent (a new
    claim, attempt 1, no Redis expiry) while a live one in the same batch stays existing."""
    client = redis.Redis.from_url(redis_url)
    clock = FakeClock()
    store = RedisStore(client, prefix=prefix, clock=clock)
    first = store.claim_many(
        "billing", [ClaimRequest("old", "f", "t1"), ClaimRequest("done", None, "t2")],
        lease_ms=10, keep_ms=10, takeover=False,
    )  # fmt: skip
    store.complete("billing", "done", token="t2", result=b"r", keep_ms=1_000)
    clock.advance(timedelta(milliseconds=10))
    assert store.stats().expired == 1 and client.exists(RedisKeys(prefix).record("billing", "old"))
    again = store.claim_many(
        "billing",
        [ClaimRequest("old", "g", "t3"), ClaimRequest("done", None, "t4")],
        lease_ms=10,
        keep_ms=10,
        takeover=takeover,
    )
    assert [c.status for c in again] == [ClaimStatus.NEW, ClaimStatus.EXISTING]
    assert again[0].record == store.get("billing", "old") != first[0].record
    assert (again[0].record.attempt, again[0].record.fingerprint) == (1, "g")
    assert again[1].record.status is Status.COMPLETED and again[1].record.result == b"r"
    assert client.pttl(RedisKeys(prefix).record("billing", "old")) == -1  # no Redis expiry
    client.close()


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.mark.services
@pytest.mark.parametrize(
    "start",
    [datetime(2001, 1, 1, tzinfo=UTC), datetime(2099, 1, 1, tzinfo=UTC)],
    ids=["clock-behind-redis", "clock-ahead-of-redis"],
)
def test_r13_a_given_clock_decides_expiry_and_redis_never_expires_early(
    redis_url: str, prefix: str, start: datetime
) -> None:
    """A clock behind Redis's would see its records vanish at once under PEXPIREAT, one ahead
    would keep them after its own expiry: neither may happen, so they carry no Redis expiry."""
    client = redis.Redis.from_url(redis_url)
    clock = FakeClock(start)
    store = RedisStore(client, prefix=prefix, clock=clock)
    name = RedisKeys(prefix).record("billing", "k")
    claim = store.claim(
        "billing", "k", fingerprint=None, token="t", lease_ms=1000, keep_ms=1000, takeover=False
    )
    assert claim.now_ms == clock.now_ms() and claim.record.expires_ms == clock.now_ms() + 1000
    assert client.pttl(name) == -1  # no Redis expiry at all
    clock.advance(timedelta(milliseconds=999))
    assert store.get("billing", "k") is not None
    clock.advance(timedelta(milliseconds=1))
    assert store.get("billing", "k") is None
    assert client.exists(name)  # still there, absent to every operation, until the purge
    assert store.stats().expired == 1
    assert store.purge_expired() == 1 and not client.exists(name)
    client.close()
