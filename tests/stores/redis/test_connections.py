"""Round trips per call (single server and cluster), scripts reloaded after SCRIPT FLUSH,
dropped connections replaced, the store's own bounded pool, a forked child, and the
exchange's one resend."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as ConnError
from redis.retry import Retry

import oncely
from oncely import Outcome, StoreUnavailable
from oncely._core.records import ClaimRequest
from oncely.stores import ClaimStatus
from oncely.stores.redis import async_io, sync_io
from oncely.stores.redis.async_store import AsyncRedisStore
from oncely.stores.redis.sync_store import RedisStore
from tests import redis_cluster
from tests.backends.redis import drop_prefix, with_options
from tests.stores.redis.helpers import KEEP_MS, LEASE_MS, _charge

# ------------------------------------------------------------------------ round trips


@pytest.mark.services
def test_a_new_key_takes_two_round_trips_and_a_duplicate_one(
    private_port: int, prefix: str, sends: Counter[int]
) -> None:
    """Client side (writes per connection) and server side (INFO commandstats) agree."""
    store = oncely.open(f"redis://127.0.0.1:{private_port}/0?prefix={prefix}")
    inbox = oncely.Inbox(store, consumer="billing")
    inbox.handle("warm-up", {"a": 0}, _charge)  # schema marker, scripts loaded, pool filled
    warm = [ClaimRequest("warm-up-batch", None, "w")]  # the batch claim's own script
    store.claim_many("billing", warm, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    admin = redis.Redis(port=private_port)
    admin.config_resetstat()
    sends.clear()
    assert inbox.handle("order-1", {"a": 1}, _charge).outcome is Outcome.PROCESSED
    assert sends[private_port] == 2
    assert inbox.handle("order-1", {"a": 1}, _charge).outcome is Outcome.DUPLICATE
    assert sends[private_port] == 3
    calls = {
        name.removeprefix("cmdstat_"): stats["calls"]
        for name, stats in admin.info("commandstats").items()
        if name not in ("cmdstat_config|resetstat", "cmdstat_info")
    }
    # Three scripts sent; the rest are the commands those scripts ran inside the server.
    assert calls.pop("evalsha") == 3
    assert set(calls) <= {"time", "get", "set", "del"}, calls
    sends.clear()
    batch = [ClaimRequest(f"b{i}", None, f"t{i}") for i in range(1200)]  # over one script's 500
    claims = store.claim_many("billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    assert sends[private_port] == 1 and len(claims) == 1200
    drop_prefix(admin, prefix)
    store.close()


@pytest.mark.services
async def test_the_asyncio_store_takes_the_same_round_trips(
    private_port: int, prefix: str, sends: Counter[int]
) -> None:
    store = oncely.open_async(f"redis://127.0.0.1:{private_port}/0?prefix={prefix}")
    inbox = oncely.AsyncInbox(store, consumer="billing")

    async def charge(payload: object) -> object:
        return payload

    await inbox.handle("warm-up", {"a": 0}, charge)
    warm = [ClaimRequest("warm-up-batch", None, "w")]  # the batch claim's own script
    await store.claim_many("billing", warm, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    sends.clear()
    assert (await inbox.handle("order-1", {"a": 1}, charge)).outcome is Outcome.PROCESSED
    assert sends[private_port] == 2
    assert (await inbox.handle("order-1", {"a": 1}, charge)).outcome is Outcome.DUPLICATE
    assert sends[private_port] == 3
    sends.clear()
    batch = [ClaimRequest(f"b{i}", None, f"t{i}") for i in range(100)]
    await store.claim_many("billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    assert sends[private_port] == 1
    await store.aclose()


@pytest.mark.services
def test_on_a_cluster_a_batch_is_one_round_trip_per_node(
    cluster: redis_cluster.Cluster, prefix: str, sends: Counter[int]
) -> None:
    store = oncely.open(with_options(cluster.url, prefix=prefix))
    inbox = oncely.Inbox(store, consumer="billing")
    warm = [ClaimRequest(f"w{i}", None, f"w{i}") for i in range(60)]
    store.claim_many("billing", warm, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    inbox.handle("warm-up", {"a": 0}, _charge)
    sends.clear()
    assert inbox.handle("order-1", {"a": 1}, _charge).outcome is Outcome.PROCESSED
    assert sum(sends.values()) == 2
    sends.clear()
    assert inbox.handle("order-1", {"a": 1}, _charge).outcome is Outcome.DUPLICATE
    assert sum(sends.values()) == 1
    sends.clear()
    batch = [ClaimRequest(f"b{i}", None, f"t{i}") for i in range(300)]
    claims = store.claim_many("billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False)
    assert [c.status for c in claims] == [ClaimStatus.NEW] * 300
    assert set(sends) == set(cluster.ports) and set(sends.values()) == {1}
    store.close()


# ------------------------------------------------------------ scripts and connections


@pytest.mark.services
def test_every_client_kind_reloads_flushed_scripts_and_survives_killed_connections(
    private_port: int, prefix: str
) -> None:
    """A single Redis client goes through the store's own send path, a single-connection client
    through redis-py's: both load the scripts again after SCRIPT FLUSH (a restarted server), and
    a connection the server dropped is replaced without an error reaching the caller."""
    admin = redis.Redis(port=private_port)
    # One resend on a dropped connection, as the store's own clients do (redis-py 5 needs
    # retry_on_error for it; later versions retry by default).
    resend: dict[str, Any] = {"retry": Retry(NoBackoff(), 1), "retry_on_error": [ConnError]}
    for client in (
        redis.Redis(port=private_port, **resend),
        redis.Redis(port=private_port, single_connection_client=True, **resend),
    ):
        store = RedisStore(client, prefix=prefix)
        inbox = oncely.Inbox(store, consumer=f"kind-{id(client)}")
        for step in range(3):
            admin.script_flush()
            admin.client_kill_filter(_type="normal", skipme=True)
            assert inbox.handle(f"k{step}", {"a": step}, _charge).outcome is Outcome.PROCESSED
            admin.script_flush()
            assert inbox.handle(f"k{step}", {"a": step}, _charge).outcome is Outcome.DUPLICATE
            admin.script_flush()
            batch = [ClaimRequest(f"b{step}-{i}", None, f"t{step}-{i}") for i in range(3)]
            claims = store.claim_many(
                inbox.consumer, batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
            )
            assert [claim.status for claim in claims] == [ClaimStatus.NEW] * 3
        store.close()
        client.close()
    admin.close()


@pytest.mark.services
async def test_the_asyncio_clients_reload_flushed_scripts_and_survive_killed_connections(
    private_port: int, prefix: str
) -> None:
    admin = redis.Redis(port=private_port)

    async def charge(payload: object) -> object:
        return payload

    resend: dict[str, Any] = {"retry": AsyncRetry(NoBackoff(), 1), "retry_on_error": [ConnError]}
    for client in (
        redis.asyncio.Redis(port=private_port, **resend),
        redis.asyncio.Redis(port=private_port, single_connection_client=True, **resend),
    ):
        store = AsyncRedisStore(client, prefix=prefix)
        inbox = oncely.AsyncInbox(store, consumer=f"kind-{id(client)}")
        for step in range(3):
            admin.script_flush()
            admin.client_kill_filter(_type="normal", skipme=True)
            handled = await inbox.handle(f"k{step}", {"a": step}, charge)
            assert handled.outcome is Outcome.PROCESSED
            admin.script_flush()
            handled = await inbox.handle(f"k{step}", {"a": step}, charge)
            assert handled.outcome is Outcome.DUPLICATE
        await store.aclose()
        await client.aclose()
    admin.close()


@pytest.mark.services
@pytest.mark.timeout(60)
def test_the_stores_own_connections_are_bounded_and_shared_by_every_thread(
    private_port: int, prefix: str
) -> None:
    """A store that built its client runs its scripts on at most ``max_connections``
    connections of its own: more threads than that take turns, none fails; a caller that finds
    every one busy for ``timeout`` gets StoreUnavailable."""
    url = f"redis://127.0.0.1:{private_port}/0?prefix={prefix}&max_connections=2&timeout=0.3"
    store = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="pool")
    admin = redis.Redis(port=private_port)
    failures: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(40):
                handled = inbox.handle(f"{thread}-{i}", {"i": i}, _charge)
                assert handled.outcome is Outcome.PROCESSED
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not failures, failures
    scripts = [c for c in admin.client_list() if c["cmd"] == "evalsha"]
    assert 1 <= len(scripts) <= 2, scripts
    runner = store._runner  # white box: hold both connections, as two calls in flight would
    held = [runner._take(), runner._take()]
    with pytest.raises(StoreUnavailable, match="No connection available"):
        store.get("pool", "0-0")
    runner._idle += held
    assert store.get("pool", "0-0") is not None
    drop_prefix(admin, prefix)
    store.close()
    admin.close()


@pytest.mark.services
@pytest.mark.timeout(60)
async def test_the_asyncio_stores_own_connections_are_bounded_and_shared_by_every_task(
    private_port: int, prefix: str
) -> None:
    url = f"redis://127.0.0.1:{private_port}/0?prefix={prefix}&max_connections=2"
    store = oncely.open_async(url)
    inbox = oncely.AsyncInbox(store, consumer="pool")

    async def charge(payload: object) -> object:
        return payload

    async def work(task: int) -> list[Outcome]:
        return [(await inbox.handle(f"{task}-{i}", {"i": i}, charge)).outcome for i in range(20)]

    done = await asyncio.gather(*(work(t) for t in range(12)))
    assert [outcome for outcomes in done for outcome in outcomes] == [Outcome.PROCESSED] * 240
    admin = redis.Redis(port=private_port)
    scripts = [c for c in admin.client_list() if c["cmd"] == "evalsha"]
    assert 1 <= len(scripts) <= 2, scripts
    await store.aclose()
    drop_prefix(admin, prefix)
    admin.close()


@pytest.mark.services
@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_on_connections_of_its_own(private_port: int, prefix: str) -> None:
    """A child process forked from a worker must not share the parent's sockets (two processes
    reading one socket steal each other's replies): it opens its own; the parent's stay."""
    store = oncely.open(f"redis://127.0.0.1:{private_port}/0?prefix={prefix}")
    inbox = oncely.Inbox(store, consumer="fork")
    assert inbox.handle("parent-1", {"a": 1}, _charge).outcome is Outcome.PROCESSED
    parents = {conn._sock.fileno() for conn in store._runner._made}  # white box
    assert parents
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            new = inbox.handle("child-1", {"a": 2}, _charge).outcome is Outcome.PROCESSED
            seen = inbox.handle("parent-1", {"a": 1}, _charge).outcome is Outcome.DUPLICATE
            own = {conn._sock.fileno() for conn in store._runner._made}
            code = 0 if new and seen and own and not own & parents else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert inbox.handle("parent-2", {"a": 3}, _charge).outcome is Outcome.PROCESSED
    assert inbox.handle("child-1", {"a": 2}, _charge).outcome is Outcome.DUPLICATE
    assert {conn._sock.fileno() for conn in store._runner._made} == parents
    drop_prefix(redis.Redis(port=private_port), prefix)
    store.close()


# ------------------------------------------------------------------------ the exchange's resend


class _Conn:
    """A connection whose replies are scripted: an exception is raised, a value answered."""

    def __init__(self, replies: list[object], retry: Any) -> None:
        self.replies, self.retry = replies, retry
        self.sent = self.dropped = 0
        self.host, self.port = "test", 0

    def send_packed_command(self, _packed: object) -> None:
        self.sent += 1

    def read_response(self) -> object:
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def disconnect(self, nowait: bool = False) -> None:
        self.dropped += 1


class _AsyncConn(_Conn):
    async def send_packed_command(self, _packed: object) -> None:  # type: ignore[override]
        self.sent += 1

    async def read_response(self) -> object:  # type: ignore[override]
        return _Conn.read_response(self)

    async def disconnect(self, nowait: bool = False) -> None:  # type: ignore[override]
        self.dropped += 1


@pytest.mark.parametrize(
    ("replies", "answer", "sent", "dropped"),
    [
        ([b"ok"], b"ok", 1, 0),  # the common case: one send, nothing dropped
        ([ConnError("lost"), b"ok"], b"ok", 2, 1),  # a broken connection: dropped, sent again
        ([ConnError("lost"), ConnError("again")], ConnError, 2, 2),  # once only
        ([redis.ResponseError("bad"), b"ok"], redis.ResponseError, 1, 0),  # not the policy's
    ],
)
async def test_the_exchange_resends_once_by_the_connections_retry_policy(
    replies: list[object], answer: object, sent: int, dropped: int
) -> None:
    """The first attempt runs outside the policy, a failed one goes to it as its first failure:
    the same sends, drops and errors as redis-py's ``call_with_retry`` around every attempt."""
    for exchange, conn in (
        (sync_io._exchange, _Conn(list(replies), Retry(NoBackoff(), 1))),
        (async_io._exchange, _AsyncConn(list(replies), AsyncRetry(NoBackoff(), 1))),
    ):

        async def call(exchange: Any = exchange, conn: _Conn = conn) -> object:
            got = exchange(conn, (b"PING",))
            return await got if asyncio.iscoroutine(got) else got

        if isinstance(answer, type):
            with pytest.raises(answer) as raised:
                await call()
            assert raised.value.__context__ is None  # not chained to an earlier attempt's
        else:
            assert await call() == answer
        assert (conn.sent, conn.dropped) == (sent, dropped)
