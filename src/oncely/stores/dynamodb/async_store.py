"""The DynamoDB store: one item per ``(consumer, key)``, every change one conditional write.

DynamoDB API, tested on moto's server (not on AWS).

Design:

* **URL.** ``dynamodb://HOST:PORT/TABLE`` is a plain-HTTP endpoint (moto's server, DynamoDB
  Local; ``?secure=true`` for HTTPS); ``dynamodb:///TABLE?region=eu-west-1`` (or the region of
  ``AWS_REGION``) is AWS over HTTPS. Credentials come from the usual AWS environment and
  configuration chain, never from the URL; an emulator's endpoint (any but AWS's own FIPS or
  VPC endpoints, ``*.amazonaws.com``) gets placeholder ones when the environment names none.
  Options: ``region``, ``secure``, ``migrate`` (default true), ``max_connections``,
  ``timeout``, ``connect_timeout``; any other is refused.
* **Table.** The partition key ``pk`` joins consumer and key unambiguously
  (``<length of consumer>:<consumer>:<key>``), with no sort key: one consumer's records
  spread over every partition instead of heating one. DynamoDB takes at most 2,048 bytes in
  a partition key: a longer one is refused with :class:`~oncely.KeyTooLong` naming
  ``hash_long_keys``, never cut. See :mod:`.dialect` for the attributes. A table keyed
  otherwise (another application's, an AWS Lambda Powertools idempotency table keyed by
  ``id``) is refused with :class:`~oncely.ConfigurationError`: oncely needs a table of its
  own.
* **Writes.** Every state change is one conditional ``PutItem``, ``UpdateItem`` or
  ``DeleteItem`` whose condition is the state machine's (:mod:`oncely._core.state`) for the
  change, fenced by the token; a condition that fails returns the item as it was
  (``ReturnValuesOnConditionCheckFailure=ALL_OLD``) in the same round trip, and the store
  answers from it by the same rules (the existing record, or :class:`~oncely.LeaseLost`).
  A failure that comes back without the item (none was there, or an emulator that does not
  return it: dynalite, older DynamoDB Local) is followed by a strongly consistent
  ``GetItem``, and decided from that.
  A write decided from such a record (a takeover, a retry) applies only while the item is
  still that revision (``rev``), else it is decided again from the newer one. botocore sends
  a write again when its answer is lost; a condition that then fails on the write's own
  revision is that write, landed the first time (a claim answers as won, not as another's
  record). A ``release`` sent twice answers False, its item gone already. ``claim_many``
  sends its claims at once (at most ``max_connections``), each its own conditional write:
  not one ``TransactWriteItems``, where one conflict would fail the whole batch; when one
  of them fails, the batch's won claims are released before the error is raised, so a
  failed batch leaves no claims held by tokens nobody has.
* **Time.** DynamoDB has no clock a condition can read: leases and expiries are the store's
  clock, the worker's own (a :class:`~oncely.FakeClock` in tests). Workers sharing a table
  must have clocks that agree within a small fraction of the lease (NTP): a worker whose
  clock runs ahead takes over a live claim early, one that runs behind sees an expired record
  as still there.
* **Expiry.** Each item carries its expiry twice: ``ex`` in milliseconds, which every read
  and condition compares with the clock, and ``ttl_s`` in epoch seconds, DynamoDB's TTL
  attribute, which :meth:`migrate` enables so that AWS deletes expired items itself (not at
  once: within a few days, AWS says; until then an expired item is read as absent, as on
  every store).
  :meth:`purge_expired` (``oncely inbox purge``) deletes them sooner, from a ``Scan``.
* **Size.** An item holds at most 400 KB: a larger result is completed without it
  (:meth:`result_room`).
* **Transactional mode (R7).** :meth:`transaction` yields a
  :class:`~oncely.stores.dynamodb.transaction.DynamoTransaction`: a buffer of writes in the
  low-level client's ``TransactItems`` shape, your writes and the inbox's marker, sent as ONE
  ``TransactWriteItems`` when the block ends (nothing when it raises), so the marker and your
  DynamoDB writes are applied together or not at all. :meth:`claim_in` reads the item
  (strongly consistent): a live record is the answer (duplicate, in flight ...), otherwise the
  marker is put, as ``initial`` (completed), by an action whose condition is the item as read
  (absent, expired, or that revision). A worker who won the key meanwhile makes the whole
  transaction fail on that condition (or, writing it at that moment, conflict with it):
  nothing of it is written, the store raises
  :class:`~oncely.KeyTaken`, and ``handle_in_transaction`` claims again once, in a new
  transaction, answering from the winner's record (``duplicate`` with its result), not as a
  failed handler. A condition of yours that fails is :class:`~oncely.CommitRefused`, the
  handler's failure (retried); another transaction on one of your items, or throttling,
  :class:`~oncely.StoreUnavailable`. The commit carries a ``ClientRequestToken`` made from
  the claim's token, so a commit botocore sends again (its answer lost) is applied once by
  DynamoDB; an endpoint that does not honour it (moto's server) cancels the resend on the
  marker's condition, where the store finds its own revision and answers that the commit
  landed. :meth:`savepoint` drops the actions added in its block when it raises (DynamoDB has
  no savepoint; a buffer can). DynamoDB's limits are refused before anything is sent: 100
  actions (the marker is one), about 4 MB, two actions on one item (a ``Put``'s key read from
  its table's key schema, ``DescribeTable`` once per table), and any write of yours in the
  inbox's table. Nothing can be read back from the buffer, and DynamoDB cannot join a SQL
  transaction.
* **Stored offsets.** :meth:`save_offset_in` keeps a stream's next offsets in the transaction,
  as items of the inbox's table under partition keys ``#offsets:...`` (no record's can be):
  one per consumer, stream and partition (partitions consumed side by side write apart),
  conditional on the offset being still as read, and one listing the partitions kept, for
  :meth:`offsets`. A Kafka consumer writing in DynamoDB is then effectively once, its
  position committed with its writes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Self, TypeVar

from oncely._core.clock import Clock, SystemClock
from oncely._core.records import (
    Claim,
    ClaimRequest,
    Completion,
    Record,
    Status,
    StoreStats,
)
from oncely._core.state import (
    DELETE,
    UNCHANGED,
    CompleteEvent,
    FailEvent,
    Lost,
    NewState,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_forget,
    apply_release,
    apply_renew,
    apply_takeover,
    claim_event,
)
from oncely._core.table import lease_lost
from oncely._urls import redact
from oncely.errors import (
    CommitRefused,
    ConfigurationError,
    KeyTaken,
    LeaseLost,
    ResultTooLarge,
    SchemaMissing,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    TransactionEnded,
    TransactionRequired,
)
from oncely.stores._offsets import check_position
from oncely.stores.dynamodb.async_io import Client, call, close, connect, each, write
from oncely.stores.dynamodb.dialect import (
    ABSENT,
    MARKER,
    SCHEMA_VERSION,
    Item,
    from_item,
    is_record,
    new_rev,
    offsets_key,
    offsets_of,
    partition_key,
    to_item,
    ttl_seconds,
)
from oncely.stores.dynamodb.errors import (
    DRIVER_ERRORS,
    DynamoDBOptions,
    build_options,
    error_code,
    parse_url,
    translate,
)
from oncely.stores.dynamodb.transaction import MAX_BYTES, DynamoTransaction, Marker, Offsets

__all__ = ["AsyncDynamoDBStore"]

LOGGER = logging.getLogger("oncely.store")

A = TypeVar("A")
Decide = Callable[[Record | None, int], tuple[NewState, A]]

# DynamoDB keeps at most 400 KB in an item, attribute names included: a result is kept up to
# that, less room for the other attributes (the key twice, the consumer, token, note).
_ITEM_BYTES: Final = 400 * 1024
_RESULT_ROOM: Final = _ITEM_BYTES - 24 * 1024
_ROOM: Final = (_RESULT_ROOM, "DynamoDB keeps at most 400 KB in one item")
# Writes decided again when the item changed meanwhile: each failure is another writer's
# success, so this many in a row is a key fought over beyond reason.
_TRIES: Final = 64
# Items read by one page of a sampled stats(exact=False): the table is read in segments of
# about this many items, one of which is read.
_SAMPLE: Final = 4000
_IN_PROGRESS: Final = {"S": Status.IN_PROGRESS.value}


def _n(value: int) -> dict[str, str]:
    return {"N": str(value)}


def _rev(item: Item) -> str | None:
    """The revision of ``item`` (see :mod:`.dialect`)."""
    found: str | None = item.get("rev", {}).get("S")
    return found


def _as_read(current: tuple[Record, str] | None, now: int) -> tuple[str, dict[str, Any]]:
    """The condition that the item is still as read: absent (or expired), or that revision."""
    if current is None:
        return ABSENT, {":now": _n(now)}
    return "rev = :rev", {":rev": {"S": current[1]}}


# What a cancelled transaction's reasons say: not now (another transaction on one of its
# items, throttling), or the writes themselves refused (the handler's).
_BUSY_REASONS: Final = frozenset(
    {
        "TransactionConflict",
        "ThrottlingError",
        "ProvisionedThroughputExceeded",
        "RequestLimitExceeded",
    }
)


class AsyncDynamoDBStore:
    """A dedup store in a DynamoDB table (two-phase and transactional modes; see the module
    docstring).

    ``table`` is the table's name; ``endpoint_url`` (``http://HOST:PORT``) an endpoint other
    than AWS's (moto's server, DynamoDB Local); ``region`` AWS's region (else the AWS
    environment's); the other keyword arguments are the URL options of the same names
    (:meth:`from_url` opens the same store from a URL). The client is built on first use
    (opening a store never waits for the endpoint). ``migrate=True`` (the default) creates
    the table on first use, with TTL enabled on its ``ttl_s`` attribute; otherwise a missing
    table raises :class:`~oncely.SchemaMissing` naming ``oncely migrate``. The asyncio
    variant belongs to the event loop that first uses it (as its aiobotocore client does):
    open one store per loop. The threaded variant may be shared by any number of threads.
    """

    supports_transactions = True

    def __init__(
        self,
        table: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        migrate: bool = True,
        max_connections: int = 32,
        timeout: timedelta = timedelta(seconds=10),
        connect_timeout: timedelta = timedelta(seconds=5),
        clock: Clock | None = None,
    ) -> None:
        options = build_options(
            type(self).__name__,
            table=table,
            endpoint_url=endpoint_url,
            region=region,
            migrate=migrate,
            max_connections=max_connections,
            timeout=timeout,
            connect_timeout=connect_timeout,
        )
        self._setup(options, clock)

    def _setup(self, options: DynamoDBOptions, clock: Clock | None) -> None:
        self._options = options
        self._table = options.table
        self._where = options.where
        self._url = (
            f"dynamodb://{options.endpoint_url.split('://', 1)[1]}/{options.table}"
            if options.endpoint_url is not None
            else f"dynamodb:///{options.table}?region={options.region}"
        )
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._client: Client | None = None
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._closed = False
        # The key attributes of the tables a transaction's Put actions write in (DescribeTable,
        # once per table), to refuse two actions on one item before sending; None for a table
        # whose description the credentials may not read.
        self._key_names: dict[str, list[str] | None] = {}

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``dynamodb://`` URL (see the module docstring for its forms and
        options)."""
        store = cls.__new__(cls)
        store._setup(parse_url(url), clock)
        store._url = redact(url)
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def table(self) -> str:
        return self._table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    # ------------------------------------------------------------ the client

    def _error(self, exc: BaseException, doing: str) -> StoreError:
        aws = self._options.region if self._options.endpoint_url is None else None
        return translate(exc, doing, self._where, self._table, region=aws)

    async def _connected(self) -> Client:
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if self._client is None:
            try:
                self._client = await connect(self._options)
            except DRIVER_ERRORS as exc:
                raise self._error(exc, "opening the store") from exc
        return self._client

    async def _call(self, name: str, doing: str, **kwargs: Any) -> Any:
        client = await self._connected()
        try:
            return await call(client, name, TableName=self._table, **kwargs)
        except DRIVER_ERRORS as exc:
            raise self._error(exc, doing) from exc

    async def _write(self, name: str, doing: str, **kwargs: Any) -> tuple[bool, Item | None]:
        if not self._ready:
            await self._prepare()
        client = await self._connected()
        try:
            ok, item = await write(client, name, TableName=self._table, **kwargs)
            if not ok and item is None:
                # No item with the failed condition: there was none, or the endpoint does not
                # return it (ReturnValuesOnConditionCheckFailure unsupported: dynalite, older
                # DynamoDB Local). A strongly consistent read tells; deciding from a state
                # newer than the failed condition's is safe, every write being conditional.
                key = kwargs["Key"] if "Key" in kwargs else {"pk": kwargs["Item"]["pk"]}
                found = await call(
                    client, "get_item", TableName=self._table, Key=key, ConsistentRead=True
                )
                item = found.get("Item")
        except DRIVER_ERRORS as exc:
            raise self._error(exc, doing) from exc
        return ok, item

    async def aclose(self) -> None:
        """Close the client. The store cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            try:
                await close(client)
            except DRIVER_ERRORS as exc:
                raise self._error(exc, "closing") from exc

    def result_room(self) -> tuple[int, str]:
        """The most bytes an encoded result may have for this store to keep it, and why (a
        larger one is completed without it, as one over ``Limits.max_result_bytes``)."""
        return _ROOM

    # ------------------------------------------------------------ the table

    async def prepare(self) -> None:
        """Connect and check the table now (creating it when opened with ``migrate=True``),
        as the first operation would: a consumer calls it at start."""
        await self._prepare()

    async def _prepare(self) -> None:
        async with self._ready_lock:
            if self._ready:
                return
            version = await self._version()
            if version is None:
                if not self._options.migrate:
                    raise SchemaMissing(
                        f"no oncely table {self._table!r} at dynamodb {self._where}; run "
                        "`oncely migrate --store URL` or open the store with ?migrate=true "
                        "(migrate=True)"
                    )
                await self.migrate()
                return
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self._url} holds oncely schema version {version}; this oncely "
                    f"understands up to {SCHEMA_VERSION}: upgrade oncely"
                )
            self._ready = True

    async def _version(self) -> int | None:
        """The schema version the table's marker says; None without a table or marker."""
        client = await self._connected()
        try:
            described = await call(client, "describe_table", TableName=self._table)
        except DRIVER_ERRORS as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            raise self._error(exc, "reading the table's description") from exc
        self._check_layout(described["Table"])
        try:
            found = await call(
                client,
                "get_item",
                TableName=self._table,
                Key={"pk": {"S": MARKER}},
                ConsistentRead=True,
            )
        except DRIVER_ERRORS as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            raise self._error(exc, "reading the schema version") from exc
        item = found.get("Item")
        return None if item is None else int(item["version"]["N"])

    async def schema_version(self) -> int | None:
        """The schema version marked in the table, or None when there is none yet."""
        return await self._version()

    async def migrate(self) -> int:
        """Create the table if it is missing (on-demand capacity), wait until it is active,
        enable TTL on ``ttl_s`` and write the schema marker. Idempotent, safe to run from
        several processes at once; returns the schema version."""
        client = await self._connected()
        try:
            await call(
                client,
                "create_table",
                TableName=self._table,
                AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                BillingMode="PAY_PER_REQUEST",
            )
        except DRIVER_ERRORS as exc:
            if error_code(exc) != "ResourceInUseException":  # made already, or being made
                raise self._error(exc, "creating the table") from exc
        await self._active(client)
        await self._enable_ttl(client)
        try:
            await call(
                client,
                "put_item",
                TableName=self._table,
                Item={"pk": {"S": MARKER}, "version": _n(SCHEMA_VERSION)},
                ConditionExpression="attribute_not_exists(pk) OR version < :v",
                ExpressionAttributeValues={":v": _n(SCHEMA_VERSION)},
            )
        except DRIVER_ERRORS as exc:
            if error_code(exc) != "ConditionalCheckFailedException":
                raise self._error(exc, "writing the schema version") from exc
        version = await self._version()
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"{self._url} holds oncely schema version {version}; this oncely "
                f"understands up to {SCHEMA_VERSION}: upgrade oncely"
            )
        self._ready = True
        return SCHEMA_VERSION

    async def _active(self, client: Client) -> None:
        """Wait until the table is ACTIVE (AWS creates one in seconds; an emulator at once)."""
        try:
            waiter = client.get_waiter("table_exists")
            await waiter.wait(TableName=self._table, WaiterConfig={"Delay": 1, "MaxAttempts": 120})
            described = await call(client, "describe_table", TableName=self._table)
        except DRIVER_ERRORS as exc:
            raise self._error(exc, "waiting for the table to be active") from exc
        except Exception as exc:  # botocore's WaiterError
            raise StoreUnavailable(
                f"waiting for dynamodb {self._where} table {self._table!r} to be active: {exc}"
            ) from exc
        self._check_layout(described["Table"])

    def _check_layout(self, table: dict[str, Any]) -> None:
        """Refuse a table whose key is not oncely's (another application's table, an AWS
        Lambda Powertools one keyed by ``id``): its items are not records oncely can read."""
        keys = [(k.get("AttributeName"), k.get("KeyType")) for k in table.get("KeySchema", [])]
        types = {a.get("AttributeName"): a.get("AttributeType") for a in
                 table.get("AttributeDefinitions", [])}  # fmt: skip
        if keys != [("pk", "HASH")] or types.get("pk") != "S":
            found = ", ".join(f"{name} ({kind}, {types.get(name)})" for name, kind in keys)
            raise ConfigurationError(
                f"dynamodb {self._where} table {self._table!r} is keyed by {found}; oncely "
                "needs a table of its own, keyed by the partition key pk (a string) alone: "
                "name a table that does not exist yet and run `oncely migrate --store URL`"
            )

    async def _enable_ttl(self, client: Client) -> None:
        try:
            found = await call(client, "describe_time_to_live", TableName=self._table)
            ttl = found.get("TimeToLiveDescription", {})
            if ttl.get("TimeToLiveStatus") in ("ENABLED", "ENABLING"):
                if ttl.get("AttributeName") != "ttl_s":
                    LOGGER.warning(
                        "oncely store=%s: DynamoDB's TTL on table %r deletes by the attribute "
                        "%r, not oncely's ttl_s: expired records stay until `oncely inbox "
                        "purge` deletes them (a table has one TTL attribute: give oncely a "
                        "table of its own)",
                        self._url,
                        self._table,
                        ttl.get("AttributeName"),
                    )
                return
            await call(
                client,
                "update_time_to_live",
                TableName=self._table,
                TimeToLiveSpecification={"Enabled": True, "AttributeName": "ttl_s"},
            )
        except DRIVER_ERRORS as exc:
            if error_code(exc) != "ValidationException":
                raise self._error(exc, "enabling TTL") from exc
            refused = exc
        else:
            return
        # Another process enabling it meanwhile (a migrate run at once): AWS refuses with a
        # ValidationException, worded as it likes ("already enabled", "modified multiple
        # times"). TTL enabled, or being enabled, on oncely's attribute is what was wanted.
        try:
            found = await call(client, "describe_time_to_live", TableName=self._table)
        except DRIVER_ERRORS as exc:
            raise self._error(exc, "enabling TTL") from refused
        ttl = found.get("TimeToLiveDescription", {})
        status, name = ttl.get("TimeToLiveStatus"), ttl.get("AttributeName")
        if status in ("ENABLED", "ENABLING") and name == "ttl_s":
            return
        raise StoreError(
            f"enabling TTL on dynamodb {self._where} table {self._table!r} was refused "
            f"({refused}), and its TTL is {status or 'DISABLED'}"
            f"{f' on {name!r}' if name else ''}: enable TTL on the attribute ttl_s (`aws "
            "dynamodb update-time-to-live`) or give oncely a table of its own, then run "
            "`oncely migrate --store URL` again"
        ) from refused

    # ------------------------------------------------------------ deciding and writing

    async def _settle(
        self,
        op: str,
        consumer: str,
        key: str,
        pk: str,
        decide: Decide[A],
        current: tuple[Record, str] | None,
    ) -> A:
        """Ask ``decide`` (a rule of :mod:`oncely._core.state`) what to do with ``current``
        (the item as last seen; None: none, or not known yet) and write that, conditional on
        the item being what was decided on; decide again from what the item was when the
        condition failed."""
        for _ in range(_TRIES):
            now = self._clock.now_ms()
            new, answer = decide(None if current is None else current[0], now)
            if new is UNCHANGED:
                return answer
            condition, values = _as_read(current, now)
            if new is DELETE:
                ok, old = await self._write(
                    "delete_item",
                    op,
                    Key={"pk": {"S": pk}},
                    ConditionExpression=condition,
                    ExpressionAttributeValues=values,
                )
            else:
                assert isinstance(new, Record)
                rev = new_rev()
                ok, old = await self._write(
                    "put_item",
                    op,
                    Item=to_item(pk, new, rev),
                    ConditionExpression=condition,
                    ExpressionAttributeValues=values,
                )
                if not ok and old is not None and _rev(old) == rev:
                    # botocore sent the write again (its answer was lost): the first one
                    # landed, and the condition now meets that very write.
                    return answer
            if ok:
                return answer
            current = None if old is None else from_item(old)
        raise StoreUnavailable(
            f"{op}: key {key!r} (consumer {consumer!r}) changed {_TRIES} times while being "
            "written; try again"
        )

    # ------------------------------------------------------------ the message path

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        ev = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        pk = partition_key(consumer, key)
        return await self._settle(
            "claim", consumer, key, pk, lambda rec, now: apply_claim(rec, ev, now), None
        )

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        """The claims at once, one conditional write each (at most ``max_connections`` in
        flight); the requests of a key repeated in the batch one after the other, in order."""
        if not requests:
            return []
        for r in requests:
            partition_key(consumer, r.key)  # refuse a key too long before writing any
        by_key: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_key.setdefault(r.key, []).append(i)
        claims: list[Claim | None] = [None] * len(requests)

        def run(indexes: list[int]) -> Callable[[], Any]:
            async def claim_key() -> None:
                for i in indexes:
                    r = requests[i]
                    claims[i] = await self.claim(
                        consumer,
                        r.key,
                        fingerprint=r.fingerprint,
                        token=r.token,
                        lease_ms=lease_ms,
                        keep_ms=keep_ms,
                        takeover=takeover,
                    )

            return claim_key

        if not self._ready:
            await self._prepare()
        try:
            await each([run(indexes) for indexes in by_key.values()], self._options.max_connections)
        except Exception:
            # The claims are separate writes, not one statement: those that were won would
            # stay held by tokens nobody has, and their messages' redeliveries wait out the
            # lease as in flight. Given back, the batch leaves nothing behind, as on a store
            # that claims it in one statement.
            await self._release_won(consumer, claims)
            raise
        return [c for c in claims if c is not None]

    async def _release_won(self, consumer: str, claims: Sequence[Claim | None]) -> None:
        """Release the won ones of ``claims`` (a ``claim_many`` that failed), as far as the
        store lets: one that cannot be released is left to its lease."""

        def run(claim: Claim) -> Callable[[], Any]:
            async def release() -> None:
                try:
                    await self.release(consumer, claim.record.key, token=claim.record.token)
                except (StoreError, LeaseLost) as exc:
                    LOGGER.warning(
                        "oncely store=%s consumer=%s: a claim of a failed claim_many stays "
                        "until its lease lapses (%s)",
                        self._url,
                        consumer,
                        type(exc).__name__,
                    )

            return release

        won = [run(c) for c in claims if c is not None and c.won]
        if won:
            await each(won, self._options.max_connections)

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        ev = TakeoverEvent(
            claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, True), expected_token
        )
        pk = partition_key(consumer, key)
        return await self._settle(
            "takeover", consumer, key, pk, lambda rec, now: apply_takeover(rec, ev, now), None
        )

    async def _fenced(
        self,
        op: str,
        consumer: str,
        key: str,
        token: str,
        update: str,
        values: dict[str, Any],
        decide: Decide[Record | Lost],
    ) -> Record:
        """An ``UpdateItem`` that applies only while ``token`` holds the live claim (the
        state machine's condition for complete, fail and renew), answering the record it
        wrote; when it does not apply, the answer ``decide`` gives for the item as it was
        (the record again for a repeat, else :class:`~oncely.LeaseLost`)."""
        pk = partition_key(consumer, key)
        now = values[":now"]
        rev = new_rev()
        ok, item = await self._write(
            "update_item",
            op,
            Key={"pk": {"S": pk}},
            UpdateExpression=update,
            ConditionExpression="tok = :tok AND st = :ip AND ex > :now",
            ExpressionAttributeValues={
                **values,
                ":tok": {"S": token},
                ":ip": _IN_PROGRESS,
                ":now": now,
                ":rev": {"S": rev},
            },
            ReturnValues="ALL_NEW",
        )
        if ok or (item is not None and _rev(item) == rev):  # applied (maybe sent twice)
            assert item is not None
            return from_item(item)[0]
        current = None if item is None else from_item(item)
        answer = await self._settle(op, consumer, key, pk, decide, current)
        if isinstance(answer, Lost):
            raise lease_lost(op, consumer, key, answer)
        return answer

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        now = self._clock.now_ms()
        ev = CompleteEvent(token, result, keep_ms, note)
        sets = ["st = :st", "up = :now", "ex = :ex", "ttl_s = :ttl", "rev = :rev"]
        removes = []
        values: dict[str, Any] = {
            ":st": {"S": Status.COMPLETED.value},
            ":now": _n(now),
            ":ex": _n(now + keep_ms),
            ":ttl": _n(ttl_seconds(now + keep_ms)),
        }
        if result is None:
            removes.append("res")
        else:
            sets.append("res = :res")
            values[":res"] = {"B": bytes(result)}
        if note is None:
            removes.append("err")
        else:
            sets.append("err = :err")
            values[":err"] = {"S": note}
        update = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
        return await self._fenced(
            "complete",
            consumer,
            key,
            token,
            update,
            values,
            lambda rec, at: apply_complete(rec, ev, at),
        )

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """The completions at once, one conditional write each (at most
        ``max_connections`` in flight)."""
        if not completions:
            return []

        def run(c: Completion) -> Callable[[], Any]:
            async def complete_one() -> Record | LeaseLost:
                try:
                    return await self.complete(
                        consumer,
                        c.key,
                        token=c.token,
                        result=c.result,
                        keep_ms=keep_ms,
                        note=c.note,
                    )
                except LeaseLost as lost:
                    return lost

            return complete_one

        if not self._ready:
            await self._prepare()
        done: list[Record | LeaseLost] = await each(
            [run(c) for c in completions], self._options.max_connections
        )
        return done

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        now = self._clock.now_ms()
        ev = FailEvent(token, error, keep_ms)
        values: dict[str, Any] = {
            ":st": {"S": Status.FAILED.value},
            ":now": _n(now),
            ":ex": _n(now + keep_ms),
            ":ttl": _n(ttl_seconds(now + keep_ms)),
            ":err": {"S": error},
        }
        update = (
            "SET st = :st, up = :now, ex = :ex, ttl_s = :ttl, rev = :rev, err = :err REMOVE res"
        )
        return await self._fenced(
            "fail", consumer, key, token, update, values, lambda rec, at: apply_fail(rec, ev, at)
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        now = self._clock.now_ms()
        ev = RenewEvent(token, lease_ms, keep_ms)
        expires = now + max(keep_ms, lease_ms)
        values: dict[str, Any] = {
            ":now": _n(now),
            ":lu": _n(now + lease_ms),
            ":ex": _n(expires),
            ":ttl": _n(ttl_seconds(expires)),
        }
        update = "SET lu = :lu, up = :now, ex = :ex, ttl_s = :ttl, rev = :rev"
        return await self._fenced(
            "renew", consumer, key, token, update, values, lambda rec, at: apply_renew(rec, ev, at)
        )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        ev = ReleaseEvent(token)
        return await self._delete(
            "release",
            consumer,
            key,
            "tok = :tok AND st = :ip AND ex > :now",
            {":ip": _IN_PROGRESS},
            token,
            lambda rec, now: apply_release(rec, ev, now),
        )

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        ev = ReleaseEvent(token)
        return await self._delete(
            "forget",
            consumer,
            key,
            "tok = :tok AND ex > :now AND (st <> :ip OR lu <= :now)",
            {":ip": _IN_PROGRESS},
            token,
            lambda rec, now: apply_forget(rec, ev, now),
        )

    async def _delete(
        self,
        op: str,
        consumer: str,
        key: str,
        condition: str,
        values: dict[str, Any],
        token: str,
        decide: Decide[bool | Lost],
    ) -> bool:
        """A fenced ``DeleteItem``: True when it deleted; otherwise the answer ``decide``
        gives for the item as it was (False: none; :class:`~oncely.LeaseLost` with it)."""
        pk = partition_key(consumer, key)
        ok, item = await self._write(
            "delete_item",
            op,
            Key={"pk": {"S": pk}},
            ConditionExpression=condition,
            ExpressionAttributeValues={
                **values,
                ":tok": {"S": token},
                ":now": _n(self._clock.now_ms()),
            },
        )
        if ok:
            return True
        current = None if item is None else from_item(item)
        answer = await self._settle(op, consumer, key, pk, decide, current)
        if isinstance(answer, Lost):
            raise lease_lost(op, consumer, key, answer)
        return answer

    # ------------------------------------------------------------ reads and maintenance

    async def get(self, consumer: str, key: str) -> Record | None:
        if not self._ready:
            await self._prepare()
        found = await self._call(
            "get_item",
            "get",
            Key={"pk": {"S": partition_key(consumer, key)}},
            ConsistentRead=True,
        )
        item = found.get("Item")
        if item is None or not is_record(item):
            return None
        record = from_item(item)[0]
        return None if record.expires_ms <= self._clock.now_ms() else record

    async def forget(self, consumer: str, key: str) -> bool:
        if not self._ready:
            await self._prepare()
        found = await self._call(
            "delete_item",
            "forget",
            Key={"pk": {"S": partition_key(consumer, key)}},
            ReturnValues="ALL_OLD",
        )
        return bool(found.get("Attributes"))

    async def _pages(self, doing: str, **kwargs: Any) -> AsyncIterator[list[Item]]:
        """The table's items, a ``Scan`` page at a time (strongly consistent reads)."""
        if not self._ready:
            await self._prepare()
        start: dict[str, Any] | None = None
        while True:
            if start is not None:
                kwargs["ExclusiveStartKey"] = start
            page = await self._call("scan", doing, ConsistentRead=True, **kwargs)
            yield page.get("Items", [])
            start = page.get("LastEvaluatedKey")
            if not start:
                return

    async def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        """Delete expired records in batches of ``batch_size`` and return how many went.

        A ``Scan`` finds the items whose ``ex`` is past on the store's clock; each is deleted
        by a ``DeleteItem`` conditional on being expired still (a key claimed afresh
        meanwhile stays), those of a batch at once. DynamoDB's TTL deletes them too, later
        (within a few days, AWS says) and at no write cost: this is for a table that must shrink
        sooner, and for a store on a :class:`~oncely.FakeClock`."""
        if not 1 <= batch_size <= 10_000:
            raise ValueError("batch_size must be between 1 and 10000")
        now = self._clock.now_ms()
        deleted = batches = 0
        due: list[str] = []
        async for items in self._pages(
            "purge",
            FilterExpression="ex <= :now",
            ExpressionAttributeValues={":now": _n(now)},
            ProjectionExpression="pk",
        ):
            due += [item["pk"]["S"] for item in items if item["pk"]["S"] != MARKER]
            while len(due) >= batch_size:
                if max_batches is not None and batches >= max_batches:
                    return deleted
                deleted += await self._purge(due[:batch_size], now)
                del due[:batch_size]
                batches += 1
        if due and (max_batches is None or batches < max_batches):
            deleted += await self._purge(due, now)
        return deleted

    async def _purge(self, pks: list[str], now: int) -> int:
        def run(pk: str) -> Callable[[], Any]:
            async def delete() -> bool:
                ok, _item = await self._write(
                    "delete_item",
                    "purge",
                    Key={"pk": {"S": pk}},
                    ConditionExpression="ex <= :now",
                    ExpressionAttributeValues={":now": _n(now)},
                )
                return ok

            return delete

        done: list[bool] = await each([run(pk) for pk in pks], self._options.max_connections)
        return sum(done)

    async def stats(self, *, exact: bool = True) -> StoreStats:
        """Record counts per consumer and status, from a ``Scan`` of the whole table.

        ``exact=False`` reads a share of the table instead: DynamoDB's ``ItemCount``
        (``DescribeTable``, refreshed about every six hours) says how many items there are,
        and one of ``ceil(ItemCount / 4000)`` segments of the ``Scan`` (items fall into
        segments by a hash of their partition key) is read and scaled up. A table of at most
        4,000 items (by that count) is read whole: the answer is then exact, and says so.
        A table that grew since its ``ItemCount`` was refreshed is read whole too."""
        if not exact:
            return await self._estimate()
        now = self._clock.now_ms()
        counts: dict[str, dict[Status, int]] = {}
        expired = 0
        async for items in self._pages("stats", ProjectionExpression="c, st, ex"):
            for item in items:
                if "c" not in item:
                    continue  # the schema marker
                if int(item["ex"]["N"]) <= now:
                    expired += 1
                    continue
                by_status = counts.setdefault(item["c"]["S"], {})
                state = Status(item["st"]["S"])
                by_status[state] = by_status.get(state, 0) + 1
        return StoreStats(counts=counts, expired=expired)

    async def _estimate(self) -> StoreStats:
        if not self._ready:
            await self._prepare()
        described = await self._call("describe_table", "stats")
        size = int(described.get("Table", {}).get("ItemCount", 0) or 0)
        segments = max(1, math.ceil(size / _SAMPLE))
        if segments == 1:
            return await self.stats()  # few items: counted, exactly
        now = self._clock.now_ms()
        counts: dict[str, dict[Status, int]] = {}
        expired = read = 0
        async for items in self._pages(
            "stats", ProjectionExpression="c, st, ex", Segment=0, TotalSegments=segments
        ):
            for item in items:
                read += 1
                if "c" not in item:
                    continue
                if int(item["ex"]["N"]) <= now:
                    expired += 1
                    continue
                by_status = counts.setdefault(item["c"]["S"], {})
                state = Status(item["st"]["S"])
                by_status[state] = by_status.get(state, 0) + 1
        scaled = {c: {s: n * segments for s, n in by.items()} for c, by in counts.items()}
        statuses = dict.fromkeys(Status, 0)
        for by in scaled.values():
            for state, n in by.items():
                statuses[state] += n
        return StoreStats(
            counts=scaled,
            expired=expired * segments,
            exact=False,
            consumers={c: sum(by.values()) for c, by in scaled.items()},
            statuses=statuses,
            note=(
                f"one of {segments} segments of the table ({read:,} of about {size:,} "
                "items, DynamoDB's ItemCount), scaled up"
            ),
        )

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Unexpired records in ``(consumer, key)`` order, starting after ``after``.

        DynamoDB keeps no order across partitions, so every page reads the whole table
        (filtered by DynamoDB on the expiry, consumer and status) and keeps the ``limit``
        smallest: for operators, not for the message path."""
        if limit <= 0:
            return []
        now = self._clock.now_ms()
        condition = ["ex > :now"]
        values: dict[str, Any] = {":now": _n(now)}
        if consumer is not None:
            condition.append("c = :c")
            values[":c"] = {"S": consumer}
        if status is not None:
            condition.append("st = :st")
            values[":st"] = {"S": status.value}
        found: dict[tuple[str, str], Record] = {}
        async for items in self._pages(
            "scan", FilterExpression=" AND ".join(condition), ExpressionAttributeValues=values
        ):
            for item in items:
                if not is_record(item):
                    continue
                record = from_item(item)[0]
                ident = (record.consumer, record.key)
                if after is not None and ident <= after:
                    continue
                found[ident] = record
            if len(found) > limit:
                found = {i: found[i] for i in sorted(found)[:limit]}
        return [found[i] for i in sorted(found)[:limit]]

    # ------------------------------------------------------------ transactional mode (R7)

    def transaction(self, *, claim_first: bool = False) -> _Block:
        """A :class:`~oncely.stores.dynamodb.transaction.DynamoTransaction` whose writes are
        sent as one ``TransactWriteItems`` when the block ends (nothing when it raises).
        ``claim_first`` changes nothing: nothing is sent before the end anyway."""
        return _Block(self)

    def _owner(self) -> tuple[str | None, str]:
        return self._options.endpoint_url, self._options.region

    def check_transaction(self, tx: DynamoTransaction) -> None:
        """Raise :class:`~oncely.TransactionRequired` unless ``tx`` is an open transaction of
        a DynamoDB store, and :class:`~oncely.ConfigurationError` when it is one of another
        endpoint or region (one ``TransactWriteItems`` writes in one region's tables)."""
        if not isinstance(tx, DynamoTransaction):
            raise TransactionRequired(
                f"{type(tx).__name__} is not a DynamoDB transaction: open one with "
                "store.transaction(), or call without tx= to let oncely open and commit one"
            )
        if tx.ended:
            raise TransactionRequired(
                "the DynamoDB transaction has ended (committed or rolled back): open another "
                "with store.transaction(), or call without tx= to let oncely open one"
            )
        if tx._owner != self._owner():
            raise ConfigurationError(
                f"the transaction is a DynamoDB store's at {tx._owner[0] or 'aws'} (region "
                f"{tx._owner[1]}), not of {self._url}: the marker and your writes must go in "
                "one TransactWriteItems, in one region"
            )

    def in_transaction(self, tx: DynamoTransaction) -> bool:
        """Whether ``tx`` is still open (its block has not ended)."""
        return isinstance(tx, DynamoTransaction) and not tx.ended

    @asynccontextmanager
    async def savepoint(self, tx: DynamoTransaction) -> AsyncIterator[None]:
        """DynamoDB has no savepoint, but a buffer can: the actions added in the block are
        dropped when it raises, those added before stay."""
        self.check_transaction(tx)
        mark = tx._mark()
        try:
            yield
        except BaseException:
            tx._restore(mark)
            raise

    async def claim_in(
        self,
        tx: DynamoTransaction,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Claim:
        """:meth:`claim` in ``tx``: a strongly consistent read of the item, and the claim
        decided from it. A live record is the answer (nothing is added); otherwise the record
        is put as ``initial`` by an action of ``tx`` conditional on the item being still as
        read (absent, expired, or that revision), so that a worker who wins the key meanwhile
        fails the whole transaction (:class:`~oncely.KeyTaken` at its end). A marker ``tx``
        already puts for the key is read instead, as a SQL transaction reads its own rows."""
        self.check_transaction(tx)
        ev = claim_event(consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error)
        pk = partition_key(consumer, key)
        own = tx._marker(self._table, pk)
        if own is not None:
            index, marker = own
            new, claim = apply_claim(marker.record, ev, self._clock.now_ms())
            if isinstance(new, Record):
                tx._set_marker(index, to_item(pk, new, marker.rev), Marker(
                    self._table, pk, marker.rev, new))  # fmt: skip
            return claim
        if not self._ready:
            await self._prepare()
        found = await self._call("get_item", "claim", Key={"pk": {"S": pk}}, ConsistentRead=True)
        item = found.get("Item")
        current = None if item is None else from_item(item)
        now = self._clock.now_ms()
        new, claim = apply_claim(None if current is None else current[0], ev, now)
        if not isinstance(new, Record):
            return claim
        # A record read expired is as good as none: the whole item is put over it whether it
        # is still there or DynamoDB's TTL (or a purge) deleted it meanwhile, which is not
        # another worker's win (that would cancel the transaction: KeyTaken, the handler run
        # again). A put over a live record needs it as read (that revision).
        expired = current is not None and current[0].expires_ms <= now
        condition, values = _as_read(None if expired else current, now)
        rev = new_rev()
        body = {
            "TableName": self._table,
            "Item": to_item(pk, new, rev),
            "ConditionExpression": condition,
            "ExpressionAttributeValues": values,
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        tx._append({"Put": body}, body, Marker(self._table, pk, rev, new))
        return claim

    async def set_result_in(
        self,
        tx: DynamoTransaction,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
    ) -> None:
        """Keep ``result`` on the marker ``tx`` puts for the key with ``token``."""
        own = tx._marker(self._table, partition_key(consumer, key))
        if own is None or own[1].record.token != token:
            raise TransactionEnded(
                f"the transaction puts no marker of key {key!r} (consumer {consumer!r}) with "
                "this claim's token: it was rolled back to a savepoint"
            )
        index, marker = own
        item = dict(tx.actions[index]["Put"]["Item"])
        if result is None:
            item.pop("res", None)
        else:
            item["res"] = {"B": bytes(result)}
        size = tx._bytes_with(index, item)
        if size > MAX_BYTES:
            # Refused here, as a write of the handler's over the limit is when it is added:
            # DynamoDB would refuse the whole commit (the handler's failure either way).
            raise ResultTooLarge(
                f"a result of {len(result or b''):,} bytes takes the transaction to about "
                f"{size:,} bytes, over DynamoDB's 4 MB for one TransactWriteItems (the "
                "handler's writes and the marker with its result): nothing was written"
            )
        tx._set_marker(index, item, marker)

    async def prepare_offsets(self) -> None:
        """Connect and check the table: stored offsets are items of the inbox's own table,
        nothing to create."""
        if not self._ready:
            await self._prepare()

    async def offsets(self, consumer: str, stream: str) -> dict[int, int]:
        """The next offset to read of each partition of ``stream`` that ``consumer`` kept in
        its transactions (:meth:`save_offset_in`): strongly consistent reads of the item
        listing the partitions, then of each partition's item."""
        check_position(stream, 0, 0, consumer=consumer)
        index = await self._get(offsets_key(consumer, stream), "reading stored offsets")
        parts = sorted(int(p) for p in (index or {}).get("ps", {}).get("NS", []))

        def run(part: int) -> Callable[[], Any]:
            async def read() -> dict[int, int]:
                pk = offsets_key(consumer, stream, part)
                return offsets_of(await self._get(pk, "reading stored offsets"))

            return read

        kept: dict[int, int] = {}
        if parts:
            for found in await each([run(p) for p in parts], self._options.max_connections):
                kept.update(found)
        return kept

    async def _get(self, pk: str, doing: str) -> Item | None:
        if not self._ready:
            await self._prepare()
        found = await self._call("get_item", doing, Key={"pk": {"S": pk}}, ConsistentRead=True)
        item: Item | None = found.get("Item")
        return item

    async def save_offset_in(
        self, tx: DynamoTransaction, consumer: str, stream: str, part: int, next_offset: int
    ) -> None:
        """Keep ``next_offset`` as the offset to read next of ``stream``'s partition ``part``,
        in ``tx`` (it never moves back). The partition's item (in the inbox's table) is read
        once per transaction, and updated conditional on being still as read: a member of the
        group that moved it meanwhile cancels the transaction
        (:class:`~oncely.StoreUnavailable`, nothing written) rather than being moved back. A
        partition kept for the first time is added to the item listing the stream's partitions
        at once, outside ``tx`` (a set only grows; one listed whose transaction never
        committed has no item, and is not read)."""
        check_position(stream, part, next_offset, consumer=consumer)
        self.check_transaction(tx)
        pk = offsets_key(consumer, stream, part)
        state = tx._offsets_of(pk)
        if state is None:
            read = offsets_of(await self._get(pk, "reading a stored offset"))
            if not read:
                await self._call(
                    "update_item",
                    "listing a stored offset's partition",
                    Key={"pk": {"S": offsets_key(consumer, stream)}},
                    UpdateExpression="ADD ps :p",
                    ExpressionAttributeValues={":p": {"NS": [str(part)]}},
                )
            state = Offsets(pk, read, {})
        tx._move(self._table, state, part, next_offset)

    async def _commit(self, tx: DynamoTransaction) -> None:
        """Send ``tx``'s actions as one ``TransactWriteItems`` (nothing without any)."""
        tx._end()
        actions = tx.actions
        if not actions:
            return
        if not self._ready:
            await self._prepare()
        client = await self._connected()
        for action in actions:
            table = action["Put"]["TableName"] if "Put" in action else None
            if table is None or table in self._key_names:
                continue
            try:
                described = await call(client, "describe_table", TableName=table)
            except DRIVER_ERRORS as exc:
                if error_code(exc) == "ResourceNotFoundException":  # the handler's mistake
                    raise CommitRefused(
                        f"commit on dynamodb {self._where}: the transaction puts an item in "
                        f"table {table!r}, which does not exist; nothing of it was written"
                    ) from exc
                if error_code(exc) == "AccessDeniedException":
                    # Permissions for the writes only (least privilege): the check is
                    # DynamoDB's then, which refuses two actions on one item itself.
                    self._key_names[table] = None
                    continue
                raise self._error(exc, f"reading the key of table {table!r}") from exc
            self._key_names[table] = [k["AttributeName"] for k in described["Table"]["KeySchema"]]
        try:
            tx._identify(self._key_names)
        except ConfigurationError as exc:
            raise CommitRefused(str(exc)) from exc
        kwargs: dict[str, Any] = {"TransactItems": actions}
        request = tx._request_token()
        if request is not None:
            kwargs["ClientRequestToken"] = request
        try:
            await call(client, "transact_write_items", **kwargs)
        except DRIVER_ERRORS as exc:
            await self._refused(tx, exc)

    async def _refused(self, tx: DynamoTransaction, exc: BaseException) -> None:
        """Return when the commit landed after all; otherwise raise what refused it."""
        code = error_code(exc)
        if code in ("ValidationException", "ResourceNotFoundException"):
            # The request as a whole refused (an expression of yours that does not parse, an
            # item over 400 KB, a table of yours that does not exist: the inbox's was checked):
            # the handler's writes, not the store.
            what = "a table it writes in does not exist" if code != "ValidationException" else ""
            raise CommitRefused(
                f"commit on dynamodb {self._where}: {code}: "
                f"{getattr(exc, 'response', {}).get('Error', {}).get('Message', '') or what}; "
                "nothing of the transaction was written"
            ) from exc
        if code != "TransactionCanceledException":
            raise self._error(exc, "commit") from exc
        reasons = getattr(exc, "response", {}).get("CancellationReasons") or []
        taken: list[Marker] = []
        refused: list[str] = []
        busy = False
        for index, reason in enumerate(reasons):
            kind = reason.get("Code") or "None"
            if kind == "None":
                continue
            marker = tx._marker_at(index)
            if marker is not None and kind == "ConditionalCheckFailed":
                item = reason.get("Item")
                if item is None:
                    # An endpoint that does not return the item of a failed condition
                    # (ReturnValuesOnConditionCheckFailure): read it, as a single write does.
                    item = await self._get(marker.pk, "reading the item of a failed commit")
                if item is not None and _rev(item) == marker.rev:
                    # botocore sent the commit again (its answer lost) and DynamoDB did not
                    # take it as the same request: the first one landed, whole.
                    return
                taken.append(marker)
            elif marker is not None and kind == "TransactionConflict":
                # Another transaction was writing the key's item at that moment: claimed
                # again, the key is answered by what it left (its record, or none).
                taken.append(marker)
            elif kind in _BUSY_REASONS:
                busy = True
            elif kind == "ConditionalCheckFailed" and tx._is_offsets(index):
                busy = True  # the offsets moved meanwhile (another member of the group)
            else:
                refused.append(f"action {index + 1} ({kind}: {reason.get('Message', '')})")
        if taken:
            shown = ", ".join(
                f"key {m.record.key!r} (consumer {m.record.consumer!r})" for m in taken
            )
            raise KeyTaken(
                f"commit on dynamodb {self._where}: another worker recorded {shown} first (or "
                "was writing it at that moment); nothing of the transaction was written"
            ) from exc
        if refused:
            raise CommitRefused(
                f"commit on dynamodb {self._where}: the transaction was cancelled by "
                f"{'; '.join(refused)}; nothing of it was written"
            ) from exc
        if busy or not reasons:
            raise StoreUnavailable(
                f"commit on dynamodb {self._where}: the transaction was cancelled ({exc}); "
                "nothing of it was written: try again"
            ) from exc
        raise self._error(exc, "commit") from exc


class _Block:
    """``async with store.transaction() as tx``: a :class:`DynamoTransaction`, sent when the
    block ends, dropped when it raises."""

    __slots__ = ("_store", "_tx")

    def __init__(self, store: AsyncDynamoDBStore) -> None:
        self._store = store
        self._tx: DynamoTransaction | None = None

    async def __aenter__(self) -> DynamoTransaction:
        store = self._store
        if store._closed:
            raise StoreError(f"{store!r} is closed")
        self._tx = DynamoTransaction(store._owner(), store._table)
        return self._tx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tx = self._tx
        assert tx is not None
        self._tx = None
        if exc_type is not None:
            tx._end()  # nothing was sent: nothing to roll back
            return
        await self._store._commit(tx)
