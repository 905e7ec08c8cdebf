"""The Redis store's URLs, the clients it is given or builds, and its schema marker."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

import oncely
from oncely import (
    ConfigurationError,
    InvalidIdentifier,
    Outcome,
    SchemaMissing,
    SchemaTooNew,
    StoreUnavailable,
    TransactionsUnsupported,
)
from oncely.stores import ClaimRequest, ClaimStatus
from oncely.stores.redis.async_store import AsyncRedisStore
from oncely.stores.redis.dialect import RedisKeys
from oncely.stores.redis.errors import parse_url
from oncely.stores.redis.sync_store import RedisStore
from tests import redis_cluster
from tests.backends.redis import with_options
from tests.stores.redis.helpers import KEEP_MS, LEASE_MS, _charge

# ------------------------------------------------------------------------------- URLs


def test_url_options_are_read_and_unknown_ones_refused() -> None:
    options = parse_url(
        "redis://app:s3cret@cache.internal:6380/2?prefix=billing_v1&max_connections=4"
        "&timeout=1.5&connect_timeout=2&migrate=false"
    )
    assert options.server == "redis://app:s3cret@cache.internal:6380/2"
    assert (options.prefix, options.max_connections, options.migrate) == ("billing_v1", 4, False)
    assert options.timeout == timedelta(seconds=1.5)
    assert options.connect_timeout == timedelta(seconds=2)
    assert not options.cluster
    assert parse_url("redis://h").server == "redis://h/0"
    assert parse_url("rediss://h:1/0?cluster=true&ssl_ca_certs=/ca.pem").cluster
    with pytest.raises(ConfigurationError) as unknown:
        parse_url("redis://app:s3cret@h/0?prefix=x&pool=3")
    assert "'pool'" in str(unknown.value) and "s3cret" not in str(unknown.value)
    for bad in (
        "redis://h/zero",
        "redis:///0",
        "redis://h/1?cluster=true",
        "redis://h/0?ssl_ca_certs=/ca.pem",
        "redis://h/0?max_connections=0",
        "redis://h/0?timeout=0",
        "redis://h/0?migrate=perhaps",
        "postgresql://h/0",
    ):
        with pytest.raises(ConfigurationError):
            parse_url(bad)


@pytest.mark.parametrize("prefix", ["a{b}", "a:b", "a*", "", "9lives", "x" * 64])
def test_prefixes_that_could_break_the_layout_are_refused(prefix: str) -> None:
    with pytest.raises(InvalidIdentifier):
        parse_url(f"redis://h/0?prefix={prefix}")
    with pytest.raises(InvalidIdentifier):
        RedisKeys(prefix)


def test_opening_from_a_url_does_no_io_and_never_shows_the_password() -> None:
    url = "redis://app:s3cret@127.0.0.1:1/0?prefix=p&connect_timeout=1"
    store = oncely.open(url)  # nothing listens on port 1: opening must not care
    assert isinstance(store, RedisStore)
    assert "s3cret" not in store.url and "s3cret" not in repr(store)
    with pytest.raises(StoreUnavailable) as down:
        store.get("billing", "k")
    assert "s3cret" not in str(down.value)
    store.close()
    assert isinstance(oncely.open_async("rediss://h:6380/0"), AsyncRedisStore)


def test_rediss_urls_use_tls_with_the_given_ca() -> None:
    store = RedisStore.from_url("rediss://h:6380/0?ssl_ca_certs=/etc/ssl/ca.pem")
    store._connect()  # builds the client without talking to the server
    pool = store._client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ssl/ca.pem"
    store.close()


# ---------------------------------------------------------------------------- clients


@pytest.mark.services
def test_a_client_the_caller_owns_stays_open(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client, prefix=prefix)
    db = urlsplit(redis_url).path.lstrip("/") or "0"
    assert store.url.startswith("redis://") and store.url.endswith(f"/{db}?prefix={prefix}")
    inbox = oncely.Inbox(store, consumer="billing")
    assert inbox.handle("k", {"a": 1}, _charge).outcome is Outcome.PROCESSED
    assert inbox.handle("k", {"a": 1}, _charge).outcome is Outcome.DUPLICATE
    store.close()
    assert client.ping()  # still the caller's to use and close
    client.close()


def test_clients_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="decode_responses"):
        RedisStore(redis.Redis(decode_responses=True))
    with pytest.raises(ConfigurationError, match="client"):
        RedisStore(redis.asyncio.Redis())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="from_url"):
        RedisStore("redis://127.0.0.1:6379/0")  # type: ignore[arg-type]


@pytest.mark.services
async def test_asyncio_clients_single_and_cluster(
    redis_url: str, cluster: redis_cluster.Cluster, prefix: str
) -> None:
    clients: list[redis.asyncio.Redis | AsyncRedisCluster] = [
        redis.asyncio.Redis.from_url(redis_url),
        AsyncRedisCluster(host="127.0.0.1", port=cluster.ports[0]),
    ]
    for client in clients:
        store = AsyncRedisStore(client, prefix=prefix)
        inbox = oncely.AsyncInbox(store, consumer="billing")

        async def charge(payload: object) -> object:
            return payload

        assert (await inbox.handle("k", {"a": 1}, charge)).outcome is Outcome.PROCESSED
        again = await inbox.handle("k", {"a": 1}, charge)
        assert again.outcome is Outcome.DUPLICATE and again.value == {"a": 1}
        many = await store.claim_many(
            "billing",
            [ClaimRequest(f"b{i}", None, f"t{i}") for i in range(40)],
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=False,
        )
        assert [c.status for c in many] == [ClaimStatus.NEW] * 40
        await store.aclose()
        assert await client.ping()
        await client.aclose()


@pytest.mark.services
def test_r7_redis_has_no_transactional_mode(redis_url: str, prefix: str) -> None:
    store = oncely.open(with_options(redis_url, prefix=prefix))
    try:
        assert not isinstance(store, oncely.TransactionalStore)
        assert store.supports_transactions is False  # type: ignore[attr-defined]
        inbox = oncely.Inbox(store, consumer="billing")
        with pytest.raises(TransactionsUnsupported, match="two-phase"):
            inbox.handle_in_transaction("k", {"a": 1}, lambda tx, payload: None)
    finally:
        store.close()


# ----------------------------------------------------------------------------- schema


@pytest.mark.services
def test_migrate_false_needs_the_marker_and_migrate_writes_it(redis_url: str, prefix: str) -> None:
    store = oncely.open(with_options(redis_url, prefix=prefix, migrate="false"))
    try:
        with pytest.raises(SchemaMissing, match="oncely migrate"):
            store.get("billing", "k")
        assert store.schema_version() is None  # type: ignore[attr-defined]
        assert store.migrate() == store.migrate() == 1
        assert store.schema_version() == 1  # type: ignore[attr-defined]
        assert store.get("billing", "k") is None
    finally:
        store.close()


@pytest.mark.services
def test_a_newer_schema_is_refused(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.hset(f"{prefix}:meta", "schema_version", "99")
    store = RedisStore(client, prefix=prefix)
    with pytest.raises(SchemaTooNew, match="upgrade oncely"):
        store.get("billing", "k")
    client.close()


def test_r10_the_result_room_is_redis_512_mb_bound() -> None:
    """A result is one argument of the completion and one field of the record's string,
    each at most 512 MB (proto-max-bulk-len): a larger one is completed without it."""
    store = RedisStore.from_url("redis://127.0.0.1:6379/11")
    try:
        room, why = store.result_room()
        assert room == 512 * 1024 * 1024 - 64 * 1024
        assert "proto-max-bulk-len" in why
    finally:
        store.close()
