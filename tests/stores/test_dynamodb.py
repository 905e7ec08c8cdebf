"""The DynamoDB store's own tests, on moto's server (the contract suite runs the shared ones):
its URL, a key too long for a partition key, TTL, expired items DynamoDB has not deleted yet,
an endpoint that is down, no credentials, results near DynamoDB's 400 KB item, competing
threads and processes on the same keys (R8, R9), and the transactional mode's own cases
(R7: racing transactions, conditions, DynamoDB's limits, savepoints, a commit sent twice)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely import FakeClock, Outcome, Status
from oncely.brokers import BrokerConsumer, ConsumerSettings
from oncely.stores import ClaimRequest
from oncely.stores.dynamodb.dialect import MAX_PARTITION_KEY_BYTES, partition_key
from oncely.stores.dynamodb.errors import parse_url
from oncely.stores.dynamodb.transaction import DynamoTransaction
from oncely.testing import MemoryBroker
from tests.backends import Scope
from tests.backends.dynamodb import (
    SyncDynamoDBLedger,
    client,
    drop_table,
    endpoint,
    store_url,
    table_name,
)
from tests.brokers.common import free_port

HOUR = 3_600_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2030, 1, 1, tzinfo=UTC))


@pytest.fixture
def url(scope: Scope) -> str:
    return store_url(scope)


# ---------------------------------------------------------------- the URL


def test_an_endpoint_url_names_host_port_and_table() -> None:
    found = parse_url("dynamodb://127.0.0.1:8000/orders_inbox?migrate=false&timeout=3")
    assert found.endpoint_url == "http://127.0.0.1:8000"
    assert found.table == "orders_inbox" and not found.migrate
    assert found.timeout == timedelta(seconds=3)
    assert parse_url("dynamodb://h:8000/t.x-y?secure=true").endpoint_url == "https://h:8000"


def test_an_aws_url_takes_its_region_from_the_url_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = parse_url("dynamodb:///inbox?region=eu-west-1")
    assert found.endpoint_url is None and found.region == "eu-west-1"
    assert found.where == "aws eu-west-1"
    monkeypatch.setenv("AWS_REGION", "eu-south-1")
    assert parse_url("dynamodb:///inbox").region == "eu-south-1"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with pytest.raises(oncely.ConfigurationError, match="no AWS region"):
        parse_url("dynamodb:///inbox")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("dynamodb://h:8000", "names no table"),
        ("dynamodb://h:8000/", "names no table"),
        ("dynamodb://h:8000/a b", "not a DynamoDB table name"),
        ("dynamodb://h:8000/ab", "not a DynamoDB table name"),
        ("dynamodb://localhost/t_1", "an endpoint is HOST:PORT"),
        ("dynamodb://key:secret@h:8000/t_1", "not in the URL"),
        ("dynamodb://h:8000/t_1?colour=blue", "unknown option 'colour'"),
        ("dynamodb://h:8000/t_1?migrate=perhaps", "migrate must be true or false"),
        ("dynamodb://h:8000/t_1?timeout=0", "must be positive"),
        ("dynamodb://h:8000/t_1?max_connections=0", "at least 1"),
        ("dynamodb://h:8000/t_1?region=Europe", "not an AWS region"),
        ("dynamodb:///t_1?region=eu-west-1&secure=true", "AWS is HTTPS"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(oncely.ConfigurationError, match=message):
        oncely.open(url)
    with pytest.raises(oncely.ConfigurationError, match=message):
        oncely.open_async(url)


def test_the_url_opens_both_stores_without_connecting() -> None:
    port = free_port()  # nothing listens: opening never waits for the endpoint
    store = oncely.open(f"dynamodb://127.0.0.1:{port}/t_1")
    assert type(store).__name__ == "DynamoDBStore" and store.url.endswith("/t_1")
    assert isinstance(store, oncely.TransactionalStore)
    assert isinstance(store, oncely.Store)
    astore = oncely.open_async(f"dynamodb://127.0.0.1:{port}/t_1")
    assert type(astore).__name__ == "AsyncDynamoDBStore"
    assert isinstance(astore, oncely.AsyncStore)
    assert isinstance(astore, oncely.AsyncTransactionalStore)
    # Every capability of the built-in stores.
    from oncely.stores import async_protocols, sync_protocols

    for name in ("CompletesMany", "ForgetsByToken", "Prepares", "BoundsResults", "KeepsOffsets"):
        assert isinstance(store, getattr(sync_protocols, name)), name
        assert isinstance(astore, getattr(async_protocols, f"Async{name}")), name
    store.close()
    asyncio.run(astore.aclose())


def test_the_constructor_takes_the_url_options_as_keyword_arguments(scope: Scope) -> None:
    from oncely.stores.dynamodb import DynamoDBStore

    store = DynamoDBStore(
        table_name(scope), endpoint_url=f"http://{endpoint()}", max_connections=4,
        timeout=timedelta(seconds=3),
    )  # fmt: skip
    store_url(scope)  # the table is dropped after the test
    try:
        assert store.url == f"dynamodb://{endpoint()}/{table_name(scope)}"
        claim = store.claim("c", "k", fingerprint=None, token="t", lease_ms=1000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        assert claim.won
    finally:
        store.close()
    same = oncely.open(store_url(scope))
    try:
        record = same.get("c", "k")
        assert record is not None and record.token == "t"
    finally:
        same.close()
    with pytest.raises(oncely.ConfigurationError, match="endpoint_url must be"):
        DynamoDBStore("t_1", endpoint_url="localhost:8000")
    with pytest.raises(oncely.ConfigurationError, match="not a DynamoDB table name"):
        DynamoDBStore("t", endpoint_url="http://localhost:8000")


# ---------------------------------------------------------------- keys and the table


def test_the_partition_key_is_unambiguous() -> None:
    assert partition_key("a:b", "c") != partition_key("a", "b:c")
    assert partition_key("ab", "c") != partition_key("a", "bc")


def test_a_key_too_long_for_a_partition_key_is_refused_naming_hash_long_keys(url: str) -> None:
    store = oncely.open(url)
    try:
        long = "k" * (MAX_PARTITION_KEY_BYTES + 1)
        with pytest.raises(oncely.KeyTooLong, match="hash_long_keys"):
            store.claim("c", long, fingerprint=None, token="t", lease_ms=1000, keep_ms=HOUR,
                        takeover=False)  # fmt: skip
        with pytest.raises(oncely.KeyTooLong, match="hash_long_keys"):
            store.claim_many(
                "c", [ClaimRequest("short", None, "t1"), ClaimRequest(long, None, "t2")],
                lease_ms=1000, keep_ms=HOUR, takeover=False,
            )  # fmt: skip
        assert store.get("c", "short") is None  # refused before any write
        # Through an inbox allowing 4 KB keys: refused, not cut; hashed when asked to.
        key = "é" * 1500  # 3,000 bytes
        inbox = oncely.Inbox(store, consumer="c", limits=oncely.Limits(max_key_bytes=4096))
        with pytest.raises(oncely.KeyTooLong, match="hash_long_keys"):
            inbox.handle(key, None, lambda p: "done")
        hashed = oncely.Inbox(
            store, consumer="c", limits=oncely.Limits(max_key_bytes=512, hash_long_keys=True)
        )
        assert hashed.handle(key, None, lambda p: "done").outcome is Outcome.PROCESSED
        assert hashed.handle(key, None, lambda p: "again").outcome is Outcome.DUPLICATE
    finally:
        store.close()


def test_migrate_enables_ttl_on_the_expiry_in_seconds(url: str, scope: Scope) -> None:
    store = oncely.open(url)
    dynamodb = client()
    try:
        assert store.migrate() == 1
        assert store.migrate() == 1  # again: nothing to do
        ttl = dynamodb.describe_time_to_live(TableName=table_name(scope))
        assert ttl["TimeToLiveDescription"] == {
            "TimeToLiveStatus": "ENABLED",
            "AttributeName": "ttl_s",
        }
        claim = store.claim("c", "k", fingerprint=None, token="t", lease_ms=1000, keep_ms=HOUR,
                            takeover=False)  # fmt: skip
        item = dynamodb.get_item(TableName=table_name(scope), Key={"pk": {"S": "1:c:k"}})["Item"]
        assert int(item["ttl_s"]["N"]) == -(-claim.record.expires_ms // 1000)
        assert int(item["ex"]["N"]) == claim.record.expires_ms
    finally:
        store.close()
        dynamodb.close()


def test_a_missing_table_without_migrate_names_oncely_migrate(scope: Scope) -> None:
    store = oncely.open(store_url(scope, migrate="false"))
    try:
        with pytest.raises(oncely.SchemaMissing, match=r"oncely migrate.*migrate=true"):
            store.get("c", "k")
        assert store.migrate() == 1
        assert store.get("c", "k") is None
    finally:
        store.close()


@pytest.mark.parametrize("migrate", ["true", "false"])
def test_a_table_keyed_otherwise_is_refused(scope: Scope, migrate: str) -> None:
    """A Powertools idempotency table (keyed by ``id``) or any other application's: its
    items are not oncely's records, and oncely writes none there."""
    url = store_url(scope, migrate=migrate)
    dynamodb = client()
    try:
        dynamodb.create_table(
            TableName=table_name(scope),
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            BillingMode="PAY_PER_REQUEST",
        )
        store = oncely.open(url)
        try:
            with pytest.raises(oncely.ConfigurationError, match=r"keyed by id \(HASH, S\)"):
                store.claim("c", "k", fingerprint=None, token="t", lease_ms=1000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
            with pytest.raises(oncely.ConfigurationError, match="a table of its own"):
                store.migrate()
        finally:
            store.close()
        assert dynamodb.scan(TableName=table_name(scope))["Items"] == []
    finally:
        dynamodb.close()


def test_ttl_on_another_attribute_is_said(
    url: str, scope: Scope, caplog: pytest.LogCaptureFixture
) -> None:
    dynamodb = client()
    try:
        dynamodb.create_table(
            TableName=table_name(scope),
            AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
            BillingMode="PAY_PER_REQUEST",
        )
        dynamodb.update_time_to_live(
            TableName=table_name(scope),
            TimeToLiveSpecification={"Enabled": True, "AttributeName": "expiration"},
        )
    finally:
        dynamodb.close()
    store = oncely.open(url)
    try:
        with caplog.at_level("WARNING", logger="oncely.store"):
            assert store.migrate() == 1
        said = [r.getMessage() for r in caplog.records if r.name == "oncely.store"]
        assert any("'expiration', not oncely's ttl_s" in line for line in said), said
    finally:
        store.close()


def test_r13_an_expired_item_dynamodb_has_not_deleted_yet_is_absent(
    url: str, scope: Scope, clock: FakeClock
) -> None:
    store = oncely.open(url, clock=clock)
    dynamodb = client()
    try:
        store.claim("c", "k", fingerprint=None, token="t1", lease_ms=1000, keep_ms=1000,
                    takeover=False)  # fmt: skip
        store.complete("c", "k", token="t1", result=b"r", keep_ms=1000)
        clock.advance(timedelta(seconds=2))
        key = {"pk": {"S": "1:c:k"}}
        assert "Item" in dynamodb.get_item(TableName=table_name(scope), Key=key)  # still there
        assert store.get("c", "k") is None
        assert store.scan() == []
        assert store.stats().expired == 1 and store.stats().total == 0
        with pytest.raises(oncely.LeaseLost):
            store.complete("c", "k", token="t1", result=b"r", keep_ms=1000)
        again = store.claim("c", "k", fingerprint=None, token="t2", lease_ms=1000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        assert again.won and again.record.attempt == 1 and again.record.token == "t2"
        assert store.purge_expired() == 0  # claimed afresh: not expired any more
        clock.advance(timedelta(hours=2))
        assert store.purge_expired() == 1
        assert "Item" not in dynamodb.get_item(TableName=table_name(scope), Key=key)
    finally:
        store.close()
        dynamodb.close()


# ---------------------------------------------------------------- faults


def test_a_store_whose_endpoint_is_down_is_unavailable() -> None:
    port = free_port()
    store = oncely.open(f"dynamodb://127.0.0.1:{port}/t_down?connect_timeout=1")
    try:
        with pytest.raises(oncely.StoreUnavailable, match=f"127.0.0.1:{port}"):
            store.get("c", "k")
        with pytest.raises(oncely.StoreUnavailable):
            store.claim("c", "k", fingerprint=None, token="t", lease_ms=1000, keep_ms=HOUR,
                        takeover=False)  # fmt: skip
    finally:
        store.close()

    async def run() -> None:
        astore = oncely.open_async(f"dynamodb://127.0.0.1:{port}/t_down?connect_timeout=1")
        try:
            with pytest.raises(oncely.StoreUnavailable):
                await astore.prepare()
        finally:
            await astore.aclose()

    asyncio.run(run())


def test_no_aws_credentials_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    store = oncely.open("dynamodb:///t_1?region=eu-west-1")
    try:
        with pytest.raises(oncely.StoreError, match="no usable AWS credentials") as raised:
            store.get("c", "k")
        assert not isinstance(raised.value, oncely.StoreUnavailable)  # a set-up to fix
    finally:
        store.close()


def test_a_mistyped_region_is_named_in_the_outage_it_causes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dynamodb:///t?region=eu-wset-1`` has the shape of a region, so it passes the URL's
    check, and its endpoint's name does not resolve: the store said "Could not connect to the
    endpoint URL", an outage to wait out, never that the region was no region. It is still
    unavailable (botocore's list lags AWS's new regions), but its message now says that
    botocore knows no such region. The name is looked up for real (and never found)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    store = oncely.open("dynamodb:///t_region?region=eu-wset-1&connect_timeout=2")
    try:
        with pytest.raises(oncely.StoreUnavailable) as raised:
            store.get("c", "k")
    finally:
        store.close()
    said = str(raised.value)
    assert "knows no AWS region 'eu-wset-1' for DynamoDB" in said, said
    assert "check the region's spelling" in said, said

    async def run() -> str:
        astore = oncely.open_async("dynamodb:///t_region?region=eu-wset-1&connect_timeout=2")
        try:
            with pytest.raises(oncely.StoreUnavailable) as raised:
                await astore.prepare()
        finally:
            await astore.aclose()
        return str(raised.value)

    assert "knows no AWS region 'eu-wset-1'" in asyncio.run(run())


@pytest.mark.parametrize(
    "host",
    ["dynamodb-fips.us-east-1.amazonaws.com", "vpce-0a1b.dynamodb.us-east-1.vpce.amazonaws.com"],
)
def test_an_aws_endpoint_url_takes_the_aws_configurations_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: str
) -> None:
    """An endpoint of AWS's own (FIPS, a VPC endpoint) named in the URL is no emulator: its
    credentials are the AWS chain's (here a credentials file; a role likewise), not the
    placeholders an emulator gets. The client is only built, nothing is sent."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[default]\naws_access_key_id = AKIAFROMTHEFILE\naws_secret_access_key = s\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = oncely.open(f"dynamodb://{host}:443/t_1?secure=true&region=us-east-1")
    emulator = oncely.open(f"dynamodb://{endpoint()}/t_1")
    try:
        signer = store._connected()._request_signer  # type: ignore[attr-defined]
        assert signer._credentials.access_key == "AKIAFROMTHEFILE"
        # An emulator's endpoint still gets the placeholders (it accepts any).
        signer = emulator._connected()._request_signer  # type: ignore[attr-defined]
        assert signer._credentials.access_key == "oncely"
    finally:
        store.close()
        emulator.close()


def test_credentials_the_endpoint_refuses_are_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """moto's server checking credentials (``INITIAL_NO_AUTH_ACTION_COUNT=0``, a server of
    the test's own), and a key it does not know."""
    import os
    import socket
    import subprocess
    import time

    from tests.brokers.sqs_broker import _stop, moto_server

    binary = moto_server()
    assert binary is not None
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    with open(tmp_path / "moto.log", "wb") as log:
        process = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)], env=env, stdout=log, stderr=log
        )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEYMOTOKNOWS")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    try:
        for _ in range(600):  # until it listens (not a timing: the test only waits)
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.05)
        store = oncely.open(f"dynamodb://127.0.0.1:{port}/t_auth")
        try:
            with pytest.raises(oncely.StoreError, match="check the AWS credentials") as raised:
                store.get("c", "k")
            assert not isinstance(raised.value, oncely.StoreUnavailable)  # a set-up to fix
        finally:
            store.close()
    finally:
        _stop(process)


# ---------------------------------------------------------------- results and modes


def test_r10_a_result_as_large_as_the_room_is_kept_and_a_larger_one_is_not(url: str) -> None:
    store = oncely.open(url)
    try:
        room, why = store.result_room()
        assert "400 KB" in why and 350 * 1024 < room < 400 * 1024
        limits = oncely.Limits(max_result_bytes=1024 * 1024, max_key_bytes=4096)
        inbox = oncely.Inbox(store, consumer="c" * 200, limits=limits)
        fits = "y" * (room - 2)  # its JSON is exactly the room
        key = "k" * 900  # long key and consumer: the room leaves space for them
        assert inbox.handle(key, None, lambda p: fits).reason is None
        repeat = inbox.handle(key, None, lambda p: "again")
        assert repeat.outcome is Outcome.DUPLICATE and repeat.value == fits
        over = inbox.handle("big", None, lambda p: "x" * (room + 1))
        assert over.outcome is Outcome.PROCESSED and over.reason is not None
        assert "400 KB" in over.reason
        record = store.get("c" * 200, "big")
        assert record is not None and record.status is Status.COMPLETED and record.result is None
    finally:
        store.close()


# ---------------------------------------------------------------- competing claims


def test_r8_threads_claiming_the_same_keys_one_wins_each(url: str) -> None:
    store = oncely.open(url)
    store.migrate()
    keys = [f"k{i}" for i in range(40)]
    wins: dict[str, list[str]] = {k: [] for k in keys}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            start.wait()
            for key in keys:
                claim = store.claim("c", key, fingerprint=None, token=f"t{n}-{key}",
                                    lease_ms=60_000, keep_ms=HOUR, takeover=False)  # fmt: skip
                if claim.won:
                    wins[key].append(claim.record.token)
            batch = store.claim_many(
                "b", [ClaimRequest(k, None, f"t{n}-{k}") for k in keys],
                lease_ms=60_000, keep_ms=HOUR, takeover=False,
            )  # fmt: skip
            for c in batch:
                if c.won:
                    wins[c.record.key].append("batch:" + c.record.token)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        for key in keys:
            assert len(wins[key]) == 2, (key, wins[key])  # one claim, one batch claim
            won = next(w for w in wins[key] if not w.startswith("batch:"))
            record = store.get("c", key)
            assert record is not None and record.token == won
    finally:
        store.close()


def test_r8_a_claim_many_that_fails_leaves_no_claims_held(url: str) -> None:
    """The batch's claims are separate writes: when one fails (here DynamoDB refuses an item
    over 400 KB), the others that were won are given back before the error is raised, as a
    store claiming the batch in one statement leaves nothing. Held, their redeliveries would
    wait out the lease as in flight."""
    requests = [
        ClaimRequest("a", None, "ta"),
        ClaimRequest("b", "x" * 500_000, "tb"),  # DynamoDB refuses this item
        ClaimRequest("c", None, "tc"),
    ]
    store = oncely.open(url)
    try:
        store.claim("c", "c", fingerprint=None, token="other", lease_ms=60_000,
                    keep_ms=HOUR, takeover=False)  # fmt: skip
        with pytest.raises(oncely.StoreError, match="maximum allowed size"):
            store.claim_many("c", requests, lease_ms=60_000, keep_ms=HOUR, takeover=False)
        assert store.get("c", "a") is None and store.get("c", "b") is None
        held = store.get("c", "c")  # another's claim, not this batch's: it stays
        assert held is not None and held.token == "other"
    finally:
        store.close()

    async def run() -> None:
        astore = oncely.open_async(url)
        try:
            with pytest.raises(oncely.StoreError, match="maximum allowed size"):
                await astore.claim_many("c", requests, lease_ms=60_000, keep_ms=HOUR,
                                        takeover=False)  # fmt: skip
            assert await astore.get("c", "a") is None and await astore.get("c", "b") is None
        finally:
            await astore.aclose()

    asyncio.run(run())


def _claim_in_process(url: str, n: int, keys: list[str], ready: Any, go: Any, out: Any) -> None:
    store = oncely.open(url)
    try:
        store.get("c", "warm")  # connected before the start
        ready.put(n)
        go.wait(60)
        won = []
        for key in keys:
            claim = store.claim("c", key, fingerprint=None, token=f"p{n}-{key}",
                                lease_ms=60_000, keep_ms=HOUR, takeover=False)  # fmt: skip
            if claim.won:
                won.append(key)
        out.put((n, won))
    finally:
        store.close()


def test_r8_processes_claiming_the_same_keys_one_wins_each(url: str) -> None:
    oncely.open(url).migrate()
    keys = [f"k{i}" for i in range(30)]
    context = multiprocessing.get_context("spawn")
    ready, out, go = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(target=_claim_in_process, args=(url, n, keys, ready, go, out))
        for n in range(4)
    ]
    for p in processes:
        p.start()
    try:
        for _ in processes:
            ready.get(timeout=120)
        go.set()
        results = [out.get(timeout=120) for _ in processes]
    finally:
        for p in processes:
            p.join(60)
    winners: dict[str, int] = {}
    for n, won in results:
        for key in won:
            assert key not in winners, (key, winners[key], n)
            winners[key] = n
    assert sorted(winners) == sorted(keys)
    store = oncely.open(url)
    try:
        for key, n in winners.items():
            record = store.get("c", key)
            assert record is not None and record.token == f"p{n}-{key}"
    finally:
        store.close()


# ---------------------------------------------------------------- the command line


def test_the_inbox_commands_work_on_the_store(url: str) -> None:
    from tests.cli.helpers import run

    store = oncely.open(url)
    oncely.Inbox(store, consumer="billing").handle("order-1", {"a": 1}, lambda p: {"ok": True})
    store.close()
    # Claimed on a clock of 2020: long expired on the command's.
    past = oncely.open(url, clock=FakeClock(datetime(2020, 1, 1, tzinfo=UTC)))
    claim = past.claim("billing", "order-2", fingerprint=None, token="t", lease_ms=1000,
                       keep_ms=1000, takeover=False)  # fmt: skip
    assert claim.won
    past.close()
    stats = run("inbox", "stats", "--store", url)
    assert stats.exit_code == 0, stats.output
    assert "billing" in stats.output and "expired, awaiting purge: 1" in stats.output
    shown = run("inbox", "show", "--store", url, "--consumer", "billing", "order-1")
    assert shown.exit_code == 0 and "completed" in shown.output and '{"ok":true}' in shown.output
    purged = run("inbox", "purge", "--store", url)
    assert purged.exit_code == 0 and "purged 1 expired record" in purged.output
    migrated = run("migrate", "--store", url)
    assert migrated.exit_code == 0 and "schema version 1" in migrated.output


# ---------------------------------------------------------------- a reply lost on the way


class _FaultyProxy:
    """A proxy in front of the test endpoint that passes the first ``target`` request (an
    ``X-Amz-Target`` such as ``DynamoDB_20120810.PutItem``) on, so it lands, and then drops
    the connection instead of the answer: botocore sends the request again, as after any
    reply lost on the network. With ``strip``, it takes the item out of every answer of a
    failed condition, as an emulator without ``ReturnValuesOnConditionCheckFailure`` answers
    (dynalite, older DynamoDB Local), a cancelled transaction's reasons too. With ``refuse``
    (a target), it answers that request with AWS's ValidationException, after passing it on
    when ``refused_lands``. With
    ``idempotent``, it keeps TransactWriteItems' ClientRequestToken as AWS does (moto's
    server ignores it): a token sent again with the same request is answered as the first
    time, without passing it on; with another request, IdempotentParameterMismatchException.
    With ``deny`` (a table's name), it answers DescribeTable of that table AccessDenied, as
    AWS does to credentials allowed the writes only."""

    def __init__(
        self,
        target: str | None,
        *,
        strip: bool = False,
        refuse: str | None = None,
        refused_lands: bool = True,
        idempotent: bool = False,
        deny: str | None = None,
    ) -> None:
        import socket

        self.deny = None if deny is None else json.dumps(deny).encode()
        self.denied = 0
        self.idempotent = idempotent
        self.tokens: dict[str, tuple[bytes, tuple[int, str, list[Any], bytes]]] = {}
        self.mismatched = 0
        self._lock = threading.Lock()
        self.target = None if target is None else target.encode()
        self.strip = strip
        self.refuse = None if refuse is None else refuse.encode()
        self.refused_lands = refused_lands
        self.dropped = self.stripped = self.refused = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        import http.client

        upstream = http.client.HTTPConnection(*endpoint().split(":"))
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:])
                size = int(headers.get("Content-Length", headers.get("content-length", "0")))
                while len(buffer) < size:
                    buffer += conn.recv(65536)
                body, buffer = buffer[:size], buffer[size:]
                refusing = self.refuse is not None and self.refuse in head
                token = None
                if self.idempotent and b"DynamoDB_20120810.TransactWriteItems" in head:
                    token = json.loads(body).get("ClientRequestToken")
                kept = None if token is None else self.tokens.get(token)
                denying = (
                    self.deny is not None
                    and b"DynamoDB_20120810.DescribeTable" in head
                    and self.deny in body
                )
                if denying:
                    self.denied += 1
                    status, reason = 400, "Bad Request"
                    answered = [("Content-Type", "application/x-amz-json-1.0")]
                    data = (
                        b'{"__type": "com.amazon.coral.service#AccessDeniedException", '
                        b'"message": "not authorized to perform: dynamodb:DescribeTable"}'
                    )
                elif kept is not None and kept[0] == body:
                    status, reason, answered, data = kept[1]  # the same request: its answer
                elif kept is not None:
                    with self._lock:
                        self.mismatched += 1
                    status, reason = 400, "Bad Request"
                    answered = [("Content-Type", "application/x-amz-json-1.0")]
                    data = (
                        b'{"__type": "com.amazonaws.dynamodb.v20120810#'
                        b'IdempotentParameterMismatchException", "message": "Request '
                        b'parameters do not match the original request with this token"}'
                    )
                elif refusing and not self.refused_lands:
                    status, reason, answered, data = 200, "OK", [], b""
                else:
                    upstream.request(method, path, body, headers)
                    reply = upstream.getresponse()
                    status, reason, answered = reply.status, reply.reason, reply.getheaders()
                    data = reply.read()
                    if token is not None:
                        self.tokens[token] = (body, (status, reason, answered, data))
                if refusing:
                    self.refused += 1
                    status, reason, answered = (
                        400,
                        "Bad Request",
                        [("Content-Type", "application/x-amz-json-1.0")],
                    )
                    data = (
                        b'{"__type": "com.amazon.coral.validate#ValidationException", '
                        b'"message": "Time to live has been modified multiple times within '
                        b'a fixed interval"}'
                    )
                if self.target is not None and self.target in head and self.dropped == 0:
                    self.dropped += 1
                    return  # the write landed; its answer is lost
                if self.strip and b"ConditionalCheckFailedException" in data:
                    answer = json.loads(data)
                    if answer.pop("Item", None) is not None:
                        self.stripped += 1
                    data = json.dumps(answer).encode()
                if self.strip and b"TransactionCanceledException" in data:
                    answer = json.loads(data)
                    for cancelled in answer.get("CancellationReasons") or []:
                        if cancelled.pop("Item", None) is not None:
                            self.stripped += 1
                    data = json.dumps(answer).encode()
                out = [f"HTTP/1.1 {status} {reason}"]
                out += [f"{k}: {v}" for k, v in answered if k.lower() not in
                        ("content-length", "transfer-encoding", "connection",
                         "x-amz-crc32")]  # the body may be changed  # fmt: skip
                out.append(f"Content-Length: {len(data)}")
                conn.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + data)


@pytest.mark.parametrize("op", ["PutItem", "UpdateItem"])
def test_r9_a_write_whose_answer_was_lost_is_known_as_its_own_when_sent_again(
    scope: Scope, op: str
) -> None:
    """botocore sends a request again when its answer is lost (a connection reset, a
    timeout): a claim or a completion that landed the first time then meets its own write,
    and answers as the write it is, not as somebody else's record."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy(f"DynamoDB_20120810.{op}")
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    try:
        claim = store.claim("c", "k", fingerprint=None, token="t1", lease_ms=60_000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        done = store.complete("c", "k", token="t1", result=b"r", keep_ms=HOUR)
        assert proxy.dropped == 1  # the write was sent twice
        assert claim.won and claim.record.token == "t1" and claim.record.attempt == 1
        assert done.status is Status.COMPLETED and done.result == b"r"
    finally:
        store.close()
        proxy.close()


def test_r8_r9_an_endpoint_that_does_not_return_the_item_of_a_failed_condition(
    scope: Scope,
) -> None:
    """Some emulators answer a failed condition without the item as it was (no
    ``ReturnValuesOnConditionCheckFailure``): a duplicate claim then tried again 64 times and
    raised StoreUnavailable ("changed 64 times"), and a completion botocore sent again was
    answered LeaseLost. The store now reads the item (strongly consistent) and decides from
    it: here moto's answers lose their item on the way, and the answers are the same as
    with it."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy("DynamoDB_20120810.UpdateItem", strip=True)
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    try:
        first = store.claim("c", "k", fingerprint=None, token="t1", lease_ms=60_000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        again = store.claim("c", "k", fingerprint=None, token="t2", lease_ms=60_000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        assert first.won and not again.won and again.record.token == "t1"  # (R8) in flight
        done = store.complete("c", "k", token="t1", result=b"r", keep_ms=HOUR)
        assert proxy.dropped == 1  # the completion was sent twice, and knew its own write
        assert done.status is Status.COMPLETED and done.result == b"r"
        # A repeat of the completion is answered with the record; another token loses.
        assert store.complete("c", "k", token="t1", result=b"r", keep_ms=HOUR) == done
        with pytest.raises(oncely.LeaseLost):
            store.complete("c", "k", token="t2", result=b"x", keep_ms=HOUR)
        late = store.claim("c", "k", fingerprint=None, token="t3", lease_ms=60_000,
                           keep_ms=HOUR, takeover=False)  # fmt: skip
        assert not late.won and late.record.result == b"r"  # (R9) a duplicate, its result
        inbox = oncely.Inbox(store, consumer="c")
        assert inbox.handle("m", None, lambda p: "done").outcome is Outcome.PROCESSED
        assert inbox.handle("m", None, lambda p: "again").outcome is Outcome.DUPLICATE
        assert proxy.stripped >= 5  # every failed condition above came without its item
    finally:
        store.close()
        proxy.close()


@pytest.mark.parametrize("lands", [True, False])
def test_a_concurrent_migrate_refused_ttl_is_settled_by_describing_it(
    scope: Scope, lands: bool
) -> None:
    """Two migrates at once on AWS: the second UpdateTimeToLive may be refused with a
    ValidationException worded otherwise than "already enabled" ("modified multiple times").
    moto never refuses it: a proxy answers AWS's refusal instead, once after moto enabled TTL
    (another process did, meanwhile: migrate succeeds) and once without (TTL still off: a
    clear error saying what to do)."""
    proxy = _FaultyProxy(None, refuse="DynamoDB_20120810.UpdateTimeToLive", refused_lands=lands)
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    scope.finalizers.append(lambda: drop_table(table_name(scope)))
    try:
        if lands:
            assert store.migrate() == 1
            assert store.get("c", "k") is None
        else:
            with pytest.raises(oncely.StoreError, match="was refused") as raised:
                store.migrate()
            assert "ValidationException" in str(raised.value)
            assert "its TTL is DISABLED" in str(raised.value)
            assert "enable TTL on the attribute ttl_s" in str(raised.value)
        assert proxy.refused == 1
    finally:
        store.close()
        proxy.close()


# ---------------------------------------------------------------- the transactional mode (R7)


@pytest.fixture
def ledger(scope: Scope) -> SyncDynamoDBLedger:
    return SyncDynamoDBLedger(scope, None)


def test_r7_a_broker_consumer_runs_transactional_handlers_on_the_store(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """Copies of a message through a consumer in the transactional mode: the handler's write
    and the marker commit in one TransactWriteItems, once."""

    async def book(tx: DynamoTransaction, payload: object) -> str:
        ledger.put(tx, "order-1", 30)
        return "booked"

    async def run() -> None:
        store = oncely.open_async(url)
        inbox = oncely.AsyncInbox(store, consumer="c")
        broker = MemoryBroker()
        for _ in range(3):
            broker.publish(b'{"order": 1}', message_id="order-1")
        try:
            # One at a time: moto's transactions are not atomic under concurrency (see
            # MOTO_SERIAL below); copies racing are the tests below.
            settings = ConsumerSettings(concurrency=1)
            consumer = BrokerConsumer(broker, inbox, book, mode="transactional", settings=settings)
            await broker.run_until_idle(consumer)
            assert consumer.counts == {"processed": 1, "duplicate": 2}
            assert broker.acked == 3 and not broker.dead
        finally:
            await store.aclose()

    asyncio.run(run())
    assert ledger.count("order-1") == 1


# The racing transactions below all read the key absent and run their handlers before any of
# them commits; then they commit one after the other. Not all at once: moto's server checks a
# TransactWriteItems' conditions and applies it without a lock (two sent at the same moment can
# both pass), and restores a whole-table copy when one is cancelled (undoing what another
# committed meanwhile); AWS runs transactions serializably. What is tested is the store's and
# the inbox's part: a commit whose marker condition meets another's record.
MOTO_SERIAL = "commits one after the other: moto's transactions are not atomic under concurrency"


def test_r7_r8_threads_racing_one_key_in_transactions_apply_it_once(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """Every worker reads the key absent and runs its handler before any commits: one
    TransactWriteItems lands; the others' are cancelled by the marker's condition, nothing of
    them written, and they answer from the winner's record (duplicate, with its result), not
    as failed handlers."""
    oncely.open(url).migrate()
    workers = 3
    claimed = threading.Barrier(workers + 1)  # the workers and the test
    turns = [threading.Event() for _ in range(workers)]
    ended = [threading.Event() for _ in range(workers)]
    outcomes: list[oncely.Handled[Any]] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        runs: list[int] = []

        def book(tx: DynamoTransaction, payload: dict[str, int]) -> dict[str, int]:
            runs.append(1)
            ledger.put(tx, "order-1", payload["amount"])
            if len(runs) == 1:  # a loser's second claim finds the record: never runs again
                claimed.wait(60)
                turns[n].wait(60)  # MOTO_SERIAL
            return {"booked": payload["amount"]}

        store = oncely.open(url)
        try:
            inbox = oncely.Inbox(store, consumer="c")
            outcomes.append(inbox.handle_in_transaction("order-1", {"amount": 30}, book))
            assert len(runs) == 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            ended[n].set()
            store.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
    for t in threads:
        t.start()
    claimed.wait(60)  # every worker read the key absent and ran its handler
    for n in range(workers):
        turns[n].set()
        assert ended[n].wait(60)
    for t in threads:
        t.join(60)
    assert not errors, errors
    kinds = [h.outcome.value for h in outcomes]
    assert kinds == ["processed"] + ["duplicate"] * (workers - 1), outcomes
    assert all(h.value == {"booked": 30} for h in outcomes)
    assert ledger.count("order-1") == 1


def _handle_in_process(url: str, table: str, claimed: Any, turn: Any, out: Any) -> None:
    store = oncely.open(url)
    try:
        inbox = oncely.Inbox(store, consumer="c")
        runs: list[int] = []

        def book(tx: DynamoTransaction, payload: object) -> str:
            runs.append(1)
            tx.put(table, {"key": {"S": "k"}, "sk": {"S": os.urandom(8).hex()}})
            if len(runs) == 1:
                claimed.wait(60)  # every process claimed before any commits
                turn.wait(60)  # MOTO_SERIAL
            return "done"

        handled = inbox.handle_in_transaction("k", None, book)
        out.put((handled.outcome.value, handled.value, len(runs)))
    finally:
        store.close()


def test_r7_r8_processes_racing_one_key_in_transactions_apply_it_once(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    oncely.open(url).migrate()
    context = multiprocessing.get_context("spawn")
    claimed, out = context.Barrier(4), context.Queue()
    turns = [context.Event() for _ in range(3)]
    processes = [
        context.Process(target=_handle_in_process, args=(url, ledger.table, claimed, turns[n], out))
        for n in range(3)
    ]
    for p in processes:
        p.start()
    try:
        claimed.wait(120)
        results = []
        for turn in turns:
            turn.set()
            results.append(out.get(timeout=60))
    finally:
        for p in processes:
            p.join(60)
    assert [r[0] for r in results] == ["processed", "duplicate", "duplicate"], results
    assert all(r[1] == "done" and r[2] == 1 for r in results)  # each handler ran once
    assert ledger.count("k") == 1


def test_r7_r8_async_transactions_racing_one_key_apply_it_once(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    async def run() -> list[oncely.Handled[Any]]:
        store = oncely.open_async(url)
        await store.migrate()
        inbox = oncely.AsyncInbox(store, consumer="c")
        claimed = asyncio.Barrier(4)
        turns = [asyncio.Event() for _ in range(3)]

        def book(n: int) -> Any:
            runs: list[int] = []

            async def booked(tx: DynamoTransaction, payload: object) -> str:
                runs.append(1)
                ledger.put(tx, "k", 1)
                if len(runs) == 1:
                    await claimed.wait()
                    await turns[n].wait()  # MOTO_SERIAL
                return "done"

            return booked

        try:
            tasks = [
                asyncio.create_task(inbox.handle_in_transaction("k", None, book(n)))
                for n in range(3)
            ]
            await asyncio.wait_for(claimed.wait(), 60)
            for n, turn in enumerate(turns):
                turn.set()
                await asyncio.wait_for(asyncio.shield(tasks[n]), 60)
            return [await t for t in tasks]
        finally:
            await store.aclose()

    outcomes = asyncio.run(run())
    assert [h.outcome.value for h in outcomes] == ["processed", "duplicate", "duplicate"]
    assert all(h.value == "done" for h in outcomes) and ledger.count("k") == 1


def test_r7_a_condition_of_the_handler_that_fails_at_the_commit_fails_it(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """A ConditionCheck of the handler's that fails cancels the whole TransactWriteItems: the
    handler's failure (retried), nothing written, no marker; once the condition holds, the
    retry processes it."""
    store = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="c")
    account = {"key": {"S": "account-1"}, "sk": {"S": "balance"}}

    def book(tx: DynamoTransaction, payload: object) -> None:
        tx.condition_check(ledger.table, account, "attribute_exists(#k)", names={"#k": "key"})
        ledger.put(tx, "order-1", 30)

    try:
        failed = inbox.handle_in_transaction("order-1", None, book)
        assert failed.outcome is Outcome.FAILED
        assert isinstance(failed.error, oncely.CommitRefused)
        assert not isinstance(failed.error, oncely.KeyTaken)
        assert "ConditionalCheckFailed" in str(failed.error)
        assert ledger.count("order-1") == 0 and inbox.get("order-1") is None
        with store.transaction() as tx:
            tx.put(ledger.table, {**account, "amount": {"N": "100"}})
        assert inbox.handle_in_transaction("order-1", None, book).outcome is Outcome.PROCESSED
        assert ledger.count("order-1") == 1
    finally:
        store.close()


def test_r7_dynamodbs_limits_are_refused_before_anything_is_sent(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    store = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="c")

    def row(n: int, size: int = 0) -> dict[str, Any]:
        return {"key": {"S": "x"}, "sk": {"S": f"{n}"}, "pad": {"S": "p" * size}}

    def hundred(tx: DynamoTransaction, payload: object) -> None:
        for n in range(100):  # with the marker, 101 actions
            tx.put(ledger.table, row(n))

    try:
        failed = inbox.handle_in_transaction("k", None, hundred)
        assert failed.outcome is Outcome.FAILED and "at most 100 actions" in str(failed.error)
        assert inbox.get("k") is None and ledger.count("x") == 0
        with (
            pytest.raises(oncely.ConfigurationError, match="inbox's own table"),
            store.transaction() as tx,
        ):
            tx.put(store.table, {"pk": {"S": "1:c:k"}})
        with (
            pytest.raises(oncely.ConfigurationError, match="at most 4 MB"),
            store.transaction() as tx,
        ):
            for n in range(11):
                tx.put(ledger.table, row(n, 390_000))
        key = {"key": {"S": "x"}, "sk": {"S": "1"}}
        with (
            pytest.raises(oncely.ConfigurationError, match="one action per item"),
            store.transaction() as tx,
        ):
            tx.update(ledger.table, key, "SET amount = :a", values={":a": {"N": "1"}})
            tx.delete(ledger.table, key)
        with (
            pytest.raises(oncely.CommitRefused, match="one action per item"),
            store.transaction() as tx,
        ):
            # a Put's key is read from the table's key schema at the commit
            tx.put(ledger.table, {**key, "amount": {"N": "1"}})
            tx.update(ledger.table, key, "SET amount = :a", values={":a": {"N": "2"}})
        with (
            pytest.raises(oncely.ConfigurationError, match="one of Put, Update"),
            store.transaction() as tx,
        ):
            tx.add({"Upsert": {"TableName": ledger.table}})
        assert ledger.count("x") == 0  # nothing of them was sent
        with store.transaction() as tx:
            for n in range(100):
                tx.put(ledger.table, row(n))
        assert ledger.count("x") == 100
    finally:
        store.close()


def test_r7_a_savepoint_drops_the_writes_of_its_block_only(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    store = oncely.open(url)
    try:
        with store.transaction() as tx:
            ledger.put(tx, "before", 1)
            with pytest.raises(ValueError, match="to the savepoint"), store.savepoint(tx):
                ledger.put(tx, "inside", 1)
                ledger.put(tx, "inside", 2)
                assert len(tx) == 3
                raise ValueError("rolled back to the savepoint")
            assert len(tx) == 1
            with store.savepoint(tx):
                ledger.put(tx, "kept", 1)
        assert tx.ended and len(tx) == 2
        assert ledger.count("before") == 1 and ledger.count("kept") == 1
        assert ledger.count("inside") == 0
        with pytest.raises(RuntimeError), store.transaction() as tx:
            ledger.put(tx, "dropped", 1)
            raise RuntimeError("nothing is sent")
        assert ledger.count("dropped") == 0
    finally:
        store.close()


def test_r7_a_transaction_of_another_store_or_no_transaction_is_refused(url: str) -> None:
    store = oncely.open(url)
    elsewhere = oncely.open(f"dynamodb://127.0.0.1:{free_port()}/t_1")  # never connected
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: object, payload: object) -> None:
        raise AssertionError("never runs")

    try:
        with (
            elsewhere.transaction() as tx,
            pytest.raises(oncely.ConfigurationError, match="one region"),
        ):
            inbox.handle_in_transaction("k", None, book, tx=tx)
        with pytest.raises(oncely.TransactionRequired, match="has ended"):
            inbox.handle_in_transaction("k", None, book, tx=tx)
        with pytest.raises(oncely.TransactionRequired, match="not a DynamoDB transaction"):
            inbox.handle_in_transaction("k", None, book, tx=object())
        with pytest.raises(oncely.TransactionRequired, match="has ended"):
            tx.put("other", {"key": {"S": "x"}})
    finally:
        store.close()
        elsewhere.close()


def test_r7_r9_a_commit_whose_answer_was_lost_is_applied_once(
    scope: Scope, ledger: SyncDynamoDBLedger
) -> None:
    """botocore sends TransactWriteItems again when its answer is lost. AWS takes the resend,
    same ClientRequestToken, as the same request; moto's server does not, and cancels it by
    the marker's condition: the marker found is this very commit's (its revision), so the
    store answers that the commit landed, once, instead of reporting another's win."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy("DynamoDB_20120810.TransactWriteItems")
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    sent: list[dict[str, Any]] = []
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: DynamoTransaction, payload: object) -> str:
        ledger.put(tx, "order-1", 30)
        return "booked"

    try:
        store.prepare()
        store._client.meta.events.register(  # what botocore sends, each time
            "before-send.dynamodb.TransactWriteItems",
            lambda request, **_: sent.append(json.loads(request.body)),
        )
        handled = inbox.handle_in_transaction("order-1", None, book)
        assert proxy.dropped == 1  # the commit was sent twice
        assert handled.outcome is Outcome.PROCESSED and handled.value == "booked"
        assert ledger.count("order-1") == 1
        record = inbox.get("order-1")
        assert record is not None and record.status is Status.COMPLETED
        tokens = {body["ClientRequestToken"] for body in sent}
        assert len(sent) == 2 and len(tokens) == 1  # one token: one request, sent twice
    finally:
        store.close()
        proxy.close()


def test_r7_r9_a_lost_commit_is_known_without_the_item_of_the_failed_condition(
    scope: Scope, ledger: SyncDynamoDBLedger
) -> None:
    """An endpoint that ignores the ClientRequestToken cancels a commit botocore sent again
    on the marker's condition; one that also leaves the item out of the cancellation reasons
    (no ReturnValuesOnConditionCheckFailure) left the store nothing to know its own marker
    by: KeyTaken, claimed again, and a commit that landed once was answered ``duplicate`` of
    itself. The store now reads the item, as its single writes do: ``processed``."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy("DynamoDB_20120810.TransactWriteItems", strip=True)
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: DynamoTransaction, payload: object) -> str:
        ledger.put(tx, "order-1", 30)
        return "booked"

    try:
        handled = inbox.handle_in_transaction("order-1", None, book)
        assert proxy.dropped == 1 and proxy.stripped == 1  # sent twice, the item left out
        assert handled.outcome is Outcome.PROCESSED and handled.value == "booked", handled
        assert ledger.count("order-1") == 1
        again = inbox.handle_in_transaction("order-1", None, book)
        assert again.outcome is Outcome.DUPLICATE and again.value == "booked"
        assert ledger.count("order-1") == 1
    finally:
        store.close()
        proxy.close()


def test_r7_r9_each_commit_has_a_client_request_token_of_its_own(
    scope: Scope, ledger: SyncDynamoDBLedger
) -> None:
    """AWS keeps a TransactWriteItems' ClientRequestToken for 10 minutes and refuses it on
    another request (IdempotentParameterMismatchException). The token was ``oncely-`` and the
    claim's token cut to 36 characters, which cut off the last digits of the claim tokens'
    counter: every commit of a process after its first, for 4096 claims, reused its token,
    and AWS refused them all. The proxy keeps tokens as AWS does (moto's server ignores
    them); a lost answer is then answered by AWS's token, not the marker's condition."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy("DynamoDB_20120810.TransactWriteItems", idempotent=True)
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: DynamoTransaction, payload: Any) -> str:
        ledger.put(tx, payload, 1)
        return "booked"

    try:
        for n in range(5):
            handled = inbox.handle_in_transaction(f"order-{n}", f"order-{n}", book)
            assert handled.outcome is Outcome.PROCESSED, handled
            assert ledger.count(f"order-{n}") == 1
        # A caller of claim_in may give one claim token to several transactions.
        for key in ("a", "b"):
            with store.transaction() as tx:
                store.claim_in(tx, "c", key, fingerprint=None, token="t1", keep_ms=HOUR,
                               takeover=False)  # fmt: skip
                ledger.put(tx, key, 1)
            assert ledger.count(key) == 1
        assert proxy.dropped == 1 and proxy.mismatched == 0
        assert len(proxy.tokens) == 7
        assert all(1 <= len(token) <= 36 for token in proxy.tokens)
    finally:
        store.close()
        proxy.close()


def test_r7_stored_offsets_are_items_of_the_table_restored_by_a_savepoint(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """Each partition's offset is an item of its own (partitions consumed side by side write
    apart), moved in the transaction only forward; a savepoint's rollback restores what was
    moved before it; a transaction whose partition another moved meanwhile is cancelled,
    never moving it back; the offsets items are no records."""
    store = oncely.open(url)
    try:
        with store.transaction() as tx:
            store.save_offset_in(tx, "c", "orders", 0, 5)
            store.save_offset_in(tx, "c", "orders", 1, 3)
            store.save_offset_in(tx, "c", "orders", 0, 4)  # lower than this transaction's 5
            assert len(tx) == 2
            with pytest.raises(ValueError, match="rolled back"), store.savepoint(tx):
                store.save_offset_in(tx, "c", "orders", 1, 9)  # the same action, moved on
                store.save_offset_in(tx, "c", "payments", 0, 1)
                ledger.put(tx, "inside", 1)
                raise ValueError("rolled back to the savepoint")
            assert len(tx) == 2
        assert store.offsets("c", "orders") == {0: 5, 1: 3}
        assert store.offsets("c", "payments") == {} and ledger.count("inside") == 0
        assert store.offsets("d", "orders") == {} and store.offsets("c", "order") == {}
        assert store.stats().counts == {} and store.scan() == []
        assert store.purge_expired() == 0
        with (
            pytest.raises(oncely.StoreUnavailable, match="cancelled"),
            store.transaction() as tx,
        ):
            store.save_offset_in(tx, "c", "orders", 1, 7)  # read 3
            ledger.put(tx, "raced", 1)
            with store.transaction() as other:
                store.save_offset_in(other, "c", "orders", 1, 8)
        assert store.offsets("c", "orders") == {0: 5, 1: 8} and ledger.count("raced") == 0
    finally:
        store.close()


def test_r7_a_write_in_a_table_that_does_not_exist_is_the_handlers_failure(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """Not a store outage (a consumer would retry it forever, the store answering the same):
    the handler's failure, retried and dead-lettered as one, nothing written."""
    store = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="c")
    key = {"key": {"S": "x"}, "sk": {"S": "1"}}

    def put(tx: DynamoTransaction, payload: object) -> None:
        ledger.put(tx, "k", 1)
        tx.put("oncely_no_such_table", key)

    def update(tx: DynamoTransaction, payload: object) -> None:
        ledger.put(tx, "k", 1)
        tx.update("oncely_no_such_table", key, "SET a = :a", values={":a": {"N": "1"}})

    try:
        for handler in (put, update):
            failed = inbox.handle_in_transaction("k", None, handler)
            assert failed.outcome is Outcome.FAILED, failed
            assert isinstance(failed.error, oncely.CommitRefused), failed.error
            assert ledger.count("k") == 0 and inbox.get("k") is None
    finally:
        store.close()


def test_a_single_write_meeting_a_transaction_on_its_item_is_retryable() -> None:
    """DynamoDB refuses a PutItem or UpdateItem on an item a TransactWriteItems is writing at
    that moment (TransactionConflictException): not now, not a broken store."""
    from botocore.exceptions import ClientError

    from oncely.stores.dynamodb.errors import translate

    refused = ClientError(
        {"Error": {"Code": "TransactionConflictException", "Message": "in a transaction"}},
        "PutItem",
    )
    assert isinstance(translate(refused, "claim", "here", "t"), oncely.StoreUnavailable)


def test_r7_a_commit_cancelled_on_the_marker_is_known_by_its_reason(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """What a cancelled TransactWriteItems says, reason by reason (AWS's answer, built here:
    moto's server never reports a conflict): another transaction on the marker's item is the
    key being taken (claimed again, answered by what it left), on an item of the handler's
    not now (StoreUnavailable), a condition of the handler's its failure (CommitRefused)."""
    from botocore.exceptions import ClientError

    store = oncely.open(url)
    try:
        with store.transaction() as tx:
            store.claim_in(tx, "c", "k", fingerprint=None, token="t1", keep_ms=HOUR, takeover=False)
            ledger.put(tx, "k", 1)

            def cancelled(*codes: str) -> ClientError:
                return ClientError(
                    {
                        "Error": {"Code": "TransactionCanceledException", "Message": "no"},
                        "CancellationReasons": [{"Code": code} for code in codes],
                    },
                    "TransactWriteItems",
                )

            with pytest.raises(oncely.KeyTaken, match="'k'"):
                store._refused(tx, cancelled("TransactionConflict", "None"))
            with pytest.raises(oncely.StoreUnavailable):
                store._refused(tx, cancelled("None", "TransactionConflict"))
            with pytest.raises(oncely.CommitRefused, match="action 2") as refused:
                store._refused(tx, cancelled("None", "ConditionalCheckFailed"))
            assert not isinstance(refused.value, oncely.KeyTaken)
            with pytest.raises(oncely.StoreUnavailable):
                store._refused(tx, cancelled("ThrottlingError", "None"))
            tx._restore((0, {}))  # nothing sent
    finally:
        store.close()


def test_r7_a_reject_whose_marker_meets_another_workers_claim_is_rejected(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """A handler's Reject is recorded by a FAILED marker in a new transaction, conditional on
    the key's item being as read. Another worker claiming the key between that read and the
    commit cancelled it, and ``handle_in_transaction`` raised KeyTaken at its caller (the
    consumer saw a store error for a poison message). It now claims again once, finds the
    other worker's record and leaves it, as a SQL store's claim does: ``rejected``."""
    store = oncely.open(url)
    other = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="c")
    meddled: list[Any] = []

    def meddle(**_: Any) -> None:  # another worker claims the key as the marker is sent
        if not meddled:
            meddled.append(other.claim("c", "k", fingerprint=None, token="t9",
                                       lease_ms=60_000, keep_ms=HOUR, takeover=False))  # fmt: skip

    def poison(tx: DynamoTransaction, payload: object) -> None:
        ledger.put(tx, "k", 1)
        raise oncely.Reject("not an order")

    try:
        store.prepare()
        store._client.meta.events.register("before-send.dynamodb.TransactWriteItems", meddle)
        handled = inbox.handle_in_transaction("k", None, poison)
        assert meddled and meddled[0].won
        assert handled.outcome is Outcome.REJECTED and "not an order" in str(handled.reason)
        record = store.get("c", "k")
        assert record is not None and record.token == "t9"  # the other worker's, untouched
        assert record.status is Status.IN_PROGRESS
        assert ledger.count("k") == 0
    finally:
        store.close()
        other.close()


def test_r7_a_result_taking_the_transaction_over_4_mb_fails_it_before_sending(
    url: str, ledger: SyncDynamoDBLedger
) -> None:
    """The 4 MB of one TransactWriteItems were checked as each write was added, but the
    handler's result is put on the marker after the handler: writes just under 4 MB and a
    result of a few hundred KB went out over the limit, which AWS refuses as a whole (moto's
    server took it). The result is now counted too: the handler's failure, nothing sent."""
    store = oncely.open(url)
    inbox = oncely.Inbox(store, consumer="c")
    sent: list[object] = []

    def big(tx: DynamoTransaction, payload: object) -> str:
        for n in range(10):  # about 4,000,000 bytes of 4 MB (4,194,304)
            tx.put(ledger.table, {"key": {"S": "big"}, "sk": {"S": f"{n}"},
                                  "pad": {"S": "p" * 400_000}})  # fmt: skip
        return "r" * 200_000  # fits an item (and max_result_bytes), not the transaction

    try:
        store.prepare()
        store._client.meta.events.register(
            "before-send.dynamodb.TransactWriteItems", lambda **_: sent.append(1)
        )
        failed = inbox.handle_in_transaction("k", None, big)
        assert failed.outcome is Outcome.FAILED, failed
        assert isinstance(failed.error, oncely.ResultTooLarge), failed.error
        assert "4 MB" in str(failed.error)
        assert sent == [] and inbox.get("k") is None and ledger.count("big") == 0
    finally:
        store.close()


def test_r7_a_transaction_taking_over_a_lapsed_claim_fences_its_owner(
    url: str, scope: Scope, clock: FakeClock, ledger: SyncDynamoDBLedger
) -> None:
    """A two-phase claim whose lease lapsed is taken over by a transactional claim (a new
    token and revision, completed with the handler's writes): the owner's later renew and
    completion are LeaseLost, never written over the transaction's record. A record expired
    but not deleted yet is claimed afresh (attempt 1)."""
    store = oncely.open(url, clock=clock)
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: DynamoTransaction, payload: Any) -> str:
        ledger.put(tx, payload, 1)
        return "booked"

    try:
        owner = store.claim("c", "k", fingerprint=None, token="t1", lease_ms=1000,
                            keep_ms=HOUR, takeover=False)  # fmt: skip
        assert owner.won
        clock.advance(timedelta(seconds=5))
        taken = inbox.handle_in_transaction("k", "k", book)
        assert taken.outcome is Outcome.STALE_RECLAIMED and taken.record is not None
        assert taken.record.attempt == 2 and taken.record.token != "t1"
        with pytest.raises(oncely.LeaseLost):
            store.renew("c", "k", token="t1", lease_ms=1000, keep_ms=HOUR)
        with pytest.raises(oncely.LeaseLost):
            store.complete("c", "k", token="t1", result=b"late", keep_ms=HOUR)
        record = store.get("c", "k")
        assert record is not None and record.status is Status.COMPLETED
        assert record.result == b'"booked"' and ledger.count("k") == 1
        clock.advance(timedelta(days=30))  # expired, still in the table
        key = {"pk": {"S": partition_key("c", "k")}}
        dynamodb = client()
        try:
            assert "Item" in dynamodb.get_item(TableName=table_name(scope), Key=key)
        finally:
            dynamodb.close()
        again = inbox.handle_in_transaction("k", "k", book)
        assert again.outcome is Outcome.PROCESSED and again.record is not None
        assert again.record.attempt == 1 and ledger.count("k") == 2
    finally:
        store.close()


def test_r7_credentials_allowed_the_writes_only_commit(
    scope: Scope, ledger: SyncDynamoDBLedger
) -> None:
    """A transaction's Put actions had their tables described (DescribeTable) to refuse two
    actions on one item before sending; credentials allowed the writes only (least
    privilege, as a Lambda function's role often is) failed every commit with a Put on a
    permissions error. The check is now DynamoDB's for such a table: the commit goes out, and
    two actions on one item are still refused, by DynamoDB, nothing written."""
    oncely.open(store_url(scope)).migrate()
    proxy = _FaultyProxy(None, deny=ledger.table)
    store = oncely.open(f"dynamodb://127.0.0.1:{proxy.port}/{table_name(scope)}")
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: DynamoTransaction, payload: Any) -> str:
        ledger.put(tx, payload, 1)
        return "booked"

    try:
        handled = inbox.handle_in_transaction("k", "k", book)
        assert handled.outcome is Outcome.PROCESSED, handled
        assert ledger.count("k") == 1 and proxy.denied == 1
        key = {"key": {"S": "twice"}, "sk": {"S": "1"}}
        with pytest.raises(oncely.CommitRefused), store.transaction() as tx:
            tx.put(ledger.table, {**key, "amount": {"N": "1"}})
            tx.update(ledger.table, key, "SET amount = :a", values={":a": {"N": "2"}})
        assert ledger.count("twice") == 0 and proxy.denied == 1  # described (denied) once
    finally:
        store.close()
        proxy.close()


def test_r7_an_expired_record_deleted_before_the_commit_is_no_other_workers_win(
    url: str, scope: Scope, clock: FakeClock, ledger: SyncDynamoDBLedger
) -> None:
    """A transactional claim over a record expired but still in the table put its marker
    conditional on that revision: DynamoDB's TTL (or a purge) deleting the item before the
    commit cancelled it as if another worker had won the key (KeyTaken), and the handler ran
    a second time. An expired record is as good as none: the marker goes over it, or in its
    place, and the handler runs once."""
    store = oncely.open(url, clock=clock)
    inbox = oncely.Inbox(store, consumer="c")
    runs: list[object] = []

    def book(tx: DynamoTransaction, payload: Any) -> str:
        runs.append(payload)
        ledger.put(tx, payload, 1)
        return "booked"

    try:
        assert inbox.handle_in_transaction("k", "k", book).outcome is Outcome.PROCESSED
        clock.advance(timedelta(days=30))  # expired, still in the table
        runs.clear()
        deleted: list[object] = []

        def ttl(**_: Any) -> None:  # DynamoDB's TTL deletes the item as the commit goes out
            if not deleted:
                dynamodb = client()
                try:
                    deleted.append(dynamodb.delete_item(
                        TableName=table_name(scope),
                        Key={"pk": {"S": partition_key("c", "k")}}))  # fmt: skip
                finally:
                    dynamodb.close()

        store._client.meta.events.register("before-send.dynamodb.TransactWriteItems", ttl)
        again = inbox.handle_in_transaction("k", "k", book)
        assert deleted and again.outcome is Outcome.PROCESSED, again
        assert runs == ["k"] and ledger.count("k") == 2  # once before it expired, once now
    finally:
        store.close()
