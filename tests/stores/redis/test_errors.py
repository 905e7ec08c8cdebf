"""How the Redis store translates errors: a closed port, a busy or read-only or paused
server is StoreUnavailable; a script error or a foreign value is a StoreError."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis._parsers.base import BaseParser

import oncely
from oncely import StoreError, StoreUnavailable
from oncely.stores import ClaimStatus
from oncely.stores.redis.dialect import RedisKeys
from oncely.stores.redis.errors import translate
from oncely.stores.redis.sync_store import RedisStore
from tests.backends.redis import drop_prefix

# ----------------------------------------------------------------------------- errors


@pytest.mark.services
@pytest.mark.timeout(30)
@pytest.mark.parametrize("cluster_mode", ["false", "true"])
def test_a_closed_port_is_unavailable_at_once(cluster_mode: str) -> None:
    with socket_bound() as port:  # a port nobody accepts on
        store = oncely.open(f"redis://127.0.0.1:{port}/0?cluster={cluster_mode}&connect_timeout=2")
        with pytest.raises(StoreUnavailable) as down:
            store.claim(
                "billing", "k", fingerprint=None, token="t", lease_ms=1, keep_ms=1,
                takeover=False,
            )  # fmt: skip
        store.close()
    # The message names the server, as PostgreSQL's store names its own (oncely's options
    # apart; a cluster says so).
    where = f"redis://127.0.0.1:{port}/0" + ("?cluster=true" if cluster_mode == "true" else "")
    assert f" on {where}: " in str(down.value), str(down.value)


def test_the_message_names_the_server_redacted() -> None:
    store = oncely.open("redis://app:s3cret@127.0.0.1:1/0?prefix=p")
    assert store._where == "redis://app:***@127.0.0.1:1/0"
    store.close()
    error = BaseParser.parse_error("LOADING Redis is loading the dataset in memory")
    translated = translate(error, "reading the schema version", "redis://h:6379/0")
    assert str(translated) == (
        "reading the schema version on redis://h:6379/0: Redis is loading the dataset in memory"
    )


class socket_bound:
    """A loopback port that is bound but never listened on: connections are refused."""

    def __enter__(self) -> int:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        return int(self._sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


@pytest.mark.services
def test_a_script_error_is_a_store_error_not_an_outage(redis_url: str, prefix: str) -> None:
    # Something else wrote under a record's name: a string not in oncely's layout, or a value
    # of another type. Either is a store error naming the problem, never an outage to retry.
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client, prefix=prefix)
    keys = RedisKeys(prefix)
    client.set(keys.record("billing", "k"), "not a record")
    client.hset(keys.record("billing", "h"), "field", "value")
    for key, expected in (("k", "not an oncely record"), ("h", "WRONGTYPE")):
        with pytest.raises(StoreError) as failed:
            store.claim(
                "billing", key, fingerprint=None, token="t", lease_ms=1, keep_ms=1, takeover=False
            )
        assert not isinstance(failed.value, StoreUnavailable)
        assert expected in str(failed.value)
    client.close()


@pytest.mark.parametrize(
    "reply",
    [
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL",
        "READONLY You can't write against a read only replica.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "CLUSTERDOWN The cluster is down",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "OOM command not allowed when used memory > 'maxmemory'.",
    ],
)
def test_transient_server_replies_mean_unavailable(reply: str) -> None:
    error = BaseParser.parse_error(reply)  # the exception redis-py raises for that reply
    assert isinstance(translate(error, "claim", "redis://h/0"), StoreUnavailable)


@pytest.mark.parametrize(
    "reply",
    [
        "ERR user_script:12: Script attempted to access nonexistent global variable",
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "WRONGPASS invalid username-password pair or user is disabled.",
    ],
)
def test_other_server_replies_are_store_errors(reply: str) -> None:
    translated = translate(BaseParser.parse_error(reply), "claim", "redis://h/0")
    assert isinstance(translated, StoreError) and not isinstance(translated, StoreUnavailable)


@pytest.mark.services
@pytest.mark.timeout(60)
def test_a_busy_server_is_unavailable(private_port: int, prefix: str) -> None:
    admin = redis.Redis(port=private_port)
    admin.config_set("busy-reply-threshold", 100)
    blocker = redis.Redis(port=private_port)
    stuck = threading.Thread(
        target=lambda: _ignore(lambda: blocker.eval("while true do end", 0)), daemon=True
    )
    store = RedisStore(redis.Redis(port=private_port), prefix=prefix)
    store.migrate()
    try:
        stuck.start()
        deadline = time.monotonic() + 10
        seen: StoreUnavailable | None = None
        while seen is None and time.monotonic() < deadline:
            try:
                store.get("billing", "k")
            except StoreUnavailable as exc:
                seen = exc
            time.sleep(0.02)
        assert seen is not None and "BUSY" in str(seen)
    finally:
        while stuck.is_alive():
            _ignore(admin.script_kill)
            stuck.join(0.1)
        admin.config_set("busy-reply-threshold", 5000)
        drop_prefix(admin, prefix)
    assert store.get("billing", "k") is None  # and fine again afterwards
    store.close()


@pytest.mark.services
@pytest.mark.timeout(60)
def test_a_read_only_replica_is_unavailable(private_port: int, prefix: str) -> None:
    admin = redis.Redis(port=private_port)
    store = RedisStore(redis.Redis(port=private_port), prefix=prefix)
    store.migrate()
    with socket_bound() as nowhere:
        admin.replicaof("127.0.0.1", nowhere)  # a replica of a primary it cannot reach
        try:
            with pytest.raises(StoreUnavailable, match="read only"):
                store.claim(
                    "billing", "k", fingerprint=None, token="t", lease_ms=1, keep_ms=1,
                    takeover=False,
                )  # fmt: skip
        finally:
            admin.replicaof("NO", "ONE")
    claim = store.claim(
        "billing", "k", fingerprint=None, token="t", lease_ms=1, keep_ms=1, takeover=False
    )
    assert claim.status is ClaimStatus.NEW
    drop_prefix(admin, prefix)
    store.close()


@pytest.mark.services
@pytest.mark.timeout(30)
def test_a_server_that_does_not_answer_in_time_is_unavailable(
    private_port: int, prefix: str
) -> None:
    store = oncely.open(f"redis://127.0.0.1:{private_port}/0?prefix={prefix}&timeout=0.2")
    store.migrate()
    admin = redis.Redis(port=private_port)
    admin.client_pause(1500)  # the server holds every client's commands for 1.5 s
    try:
        with pytest.raises(StoreUnavailable, match=r"(?i)timeout"):
            store.get("billing", "k")
    finally:
        admin.client_unpause()
    assert store.get("billing", "k") is None  # the timed-out connection was replaced
    drop_prefix(admin, prefix)
    store.close()


@pytest.mark.services
@pytest.mark.timeout(30)
def test_an_asyncio_store_times_a_silent_server_out_and_replaces_the_connection(
    private_port: int, prefix: str
) -> None:
    """R12: the asyncio store's own connections carry no socket timeout (redis-py would wrap
    every send in ``wait_for``); the store times each exchange itself. A server that holds
    the claim past the URL's timeout is ``StoreUnavailable`` about that timeout later, and
    the claim after it, on a fresh connection, gets its own reply (not the late one of the
    timed-out call)."""
    url = f"redis://127.0.0.1:{private_port}/0?prefix={prefix}&timeout=0.3"
    admin = redis.Redis(port=private_port)

    async def scenario() -> tuple[float, ClaimStatus, ClaimStatus]:
        store = oncely.open_async(url)
        await store.migrate()
        claim: dict[str, Any] = {"fingerprint": None, "lease_ms": 60_000, "keep_ms": 60_000}
        first = await store.claim("billing", "a", token="t1", takeover=False, **claim)
        assert all(conn.socket_timeout is None for conn in store._runner._made)
        admin.client_pause(1500)
        began = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable, match=r"(?i)timeout"):
                await store.claim("billing", "b", token="t2", takeover=False, **claim)
            waited = time.monotonic() - began
        finally:
            admin.client_unpause()
        again = await store.claim("billing", "a", token="t3", takeover=False, **claim)
        await store.aclose()
        return waited, first.status, again.status

    waited, first, again = asyncio.run(scenario())
    assert 0.25 <= waited < 1.4  # the store's timeout (and its one resend), not the pause
    assert first is ClaimStatus.NEW
    assert again is ClaimStatus.EXISTING  # "a"'s own record, on a working connection
    drop_prefix(admin, prefix)


@pytest.mark.services
@pytest.mark.skipif(sys.platform != "linux", reason="kernel socket timeouts are used on Linux only")
def test_the_store_waits_for_redis_in_the_kernel_with_its_timeout(
    private_port: int, prefix: str
) -> None:
    """Its sockets are blocking ones the kernel times out (SO_RCVTIMEO / SO_SNDTIMEO set to
    the URL's timeout), so a send or receive is one system call, not a poll and the call; the
    test above shows such a timeout ends as StoreUnavailable."""
    store = oncely.open(f"redis://127.0.0.1:{private_port}/0?prefix={prefix}&timeout=0.25")
    store.migrate()
    assert store.get("billing", "k") is None
    sockets = [conn._sock for conn in store._runner._made]
    assert sockets and all(sock is not None for sock in sockets)
    for sock in sockets:
        assert sock.gettimeout() is None  # blocking: Python does not poll first
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            seconds, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
            assert seconds + micros / 1e6 == pytest.approx(0.25, abs=0.02)  # kernel ticks
    drop_prefix(redis.Redis(port=private_port), prefix)
    store.close()


def _ignore(call: Callable[[], object]) -> None:
    with contextlib.suppress(redis.RedisError):
        call()


async def test_r19_a_silent_server_is_told_within_the_timeout(redis_url: str, prefix: str) -> None:
    """The threaded store's server goes silent (a dead route: the connection held, nothing
    answered, no reset; a relay swallows what it is sent): a call raises StoreUnavailable
    while the server is still silent, at the store's ``timeout`` (kernel socket timeouts):
    the Redis store was bounded already, with no watchdog of its own."""
    from tests.brokers.common import Proxy

    db11 = f"{redis_url.rsplit('/', 1)[0]}/11"
    async with Proxy(f"{db11}?prefix={prefix}&timeout=1") as proxy:
        store = oncely.open(proxy.url)
        try:
            assert await asyncio.to_thread(store.get, "c", "k") is None
            proxy.silent = True
            told = asyncio.create_task(asyncio.to_thread(store.get, "c", "k"))
            done, _ = await asyncio.wait({told}, timeout=20)
            assert done and proxy.silent, "the call waited past the store's timeout"
            with pytest.raises(StoreUnavailable):
                told.result()
        finally:
            proxy.silent = False
            proxy.cut()
            store.close()
            client = redis.Redis.from_url(db11)
            drop_prefix(client, prefix)
            client.close()
