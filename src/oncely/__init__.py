"""oncely: effectively-once message processing on top of at-least-once delivery.

The public API lives here and nowhere else; every name below is stable. Start with
:class:`Inbox` (or :class:`AsyncInbox`) on a store from :func:`open`::

    import oncely

    inbox = oncely.Inbox(oncely.open("sqlite:///oncely.db"), consumer="billing")
    handled = inbox.handle(message_id, payment, charge)   # two-phase mode (R10)
    handled = inbox.handle_in_transaction(message_id, payment, book)  # transactional (R7)
    if handled.outcome is oncely.Outcome.KEY_CONFLICT: ...
"""

# Aliased so that dir(oncely) lists the API, not this module's tools.
import importlib as _importlib
import typing as _typing
import warnings as _warnings

from oncely._core import records as _records
from oncely._core.clock import Clock, FakeClock, SystemClock
from oncely._core.codec import Codec, JSONCodec, RawCodec
from oncely._core.context import Current, current, handling
from oncely._core.fingerprint import Fingerprint, Fingerprinter, canonical_json, fingerprint
from oncely._core.keys import (
    BusinessKey,
    CloudEventsKey,
    CorrelationIdKey,
    Envelope,
    FirstOf,
    HeaderKey,
    KeySource,
    KeyWarning,
    MessageIdKey,
)
from oncely._core.observe import Hook
from oncely._core.outcomes import Action, Handled, Outcome
from oncely._core.policy import (
    Lease,
    Limits,
    OnStale,
    RedeliveryHorizon,
    Resolution,
    Resolved,
    Retention,
    StaleClaim,
    format_duration,
)
from oncely._core.records import Record, Status, StoreStats
from oncely.errors import (
    AsyncHandlerRefused,
    BrokerError,
    BrokerUnavailable,
    ClaimEnded,
    CommitRefused,
    ConfigurationError,
    Escalated,
    HandlerRefused,
    InFlight,
    InvalidIdentifier,
    InvalidKey,
    KeyConflict,
    KeyTaken,
    KeyTooLong,
    LeaseLost,
    MissingKey,
    OncelyError,
    OutcomeError,
    PayloadError,
    Reject,
    Rejected,
    ResolveRefused,
    ResultTooLarge,
    ResultUnavailable,
    RetentionTooShort,
    SchemaError,
    SchemaMissing,
    SchemaOutdated,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    TransactionEnded,
    TransactionRequired,
    TransactionsUnsupported,
    UndecodableBody,
    UnfingerprintablePayload,
)
from oncely.inbox.async_inbox import AsyncClaimed, AsyncInbox
from oncely.inbox.sync_inbox import Claimed, Inbox
from oncely.stores import open_async_store as open_async
from oncely.stores import open_store as open  # noqa: A004 - `oncely.open(url)` mirrors the URL API
from oncely.stores import redact
from oncely.stores._purging import PurgeRun
from oncely.stores.async_protocols import AsyncStore, AsyncTransactionalStore
from oncely.stores.async_purging import AsyncPurgeService
from oncely.stores.memory.async_store import AsyncMemoryStore
from oncely.stores.memory.sync_store import MemoryStore
from oncely.stores.sqlite.errors import SQLiteSettings
from oncely.stores.sqlite.sync_store import SQLiteStore
from oncely.stores.sync_protocols import Store, TransactionalStore
from oncely.stores.sync_purging import PurgeService

__version__ = "0.1.0"

if _typing.TYPE_CHECKING:  # the optional stores, for type checkers; imported lazily at run time
    from oncely._core.records import Claim as Claim
    from oncely._core.records import ClaimRequest as ClaimRequest
    from oncely._core.records import ClaimStatus as ClaimStatus
    from oncely.stores.dynamodb import AsyncDynamoDBStore as AsyncDynamoDBStore
    from oncely.stores.dynamodb import DynamoDBStore as DynamoDBStore
    from oncely.stores.mysql import AsyncMySQLStore as AsyncMySQLStore
    from oncely.stores.mysql import MySQLStore as MySQLStore
    from oncely.stores.postgres import AsyncPostgresStore as AsyncPostgresStore
    from oncely.stores.postgres import PostgresStore as PostgresStore
    from oncely.stores.redis import AsyncRedisStore as AsyncRedisStore
    from oncely.stores.redis import RedisStore as RedisStore
    from oncely.stores.sqlite import AsyncSQLiteStore as AsyncSQLiteStore

# Stores whose drivers are optional extras are imported on first use, so `import oncely` needs
# nothing beyond the standard library: `oncely.PostgresStore` works once `oncely[postgres]` is
# in, and says which extra to install when it is not.
_OPTIONAL = {
    "PostgresStore": "oncely.stores.postgres",
    "AsyncPostgresStore": "oncely.stores.postgres",
    "MySQLStore": "oncely.stores.mysql",
    "AsyncMySQLStore": "oncely.stores.mysql",
    "RedisStore": "oncely.stores.redis",
    "AsyncRedisStore": "oncely.stores.redis",
    "DynamoDBStore": "oncely.stores.dynamodb",
    "AsyncDynamoDBStore": "oncely.stores.dynamodb",
    "AsyncSQLiteStore": "oncely.stores.sqlite",
}
# Types only store authors need; they live in oncely.stores now.
_MOVED = {"Claim", "ClaimRequest", "ClaimStatus"}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        _warnings.warn(
            f"oncely.{name} is for store authors and moved to oncely.stores.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_records, name)
    package = _OPTIONAL.get(name)
    if package is None:
        raise AttributeError(f"module 'oncely' has no attribute {name!r}")
    return getattr(_importlib.import_module(package), name)


def __dir__() -> list[str]:
    """The module's names and every name of ``__all__``, those imported on first use included."""
    return sorted({*globals(), *__all__})


__all__ = [
    "Action",
    "AsyncClaimed",
    "AsyncHandlerRefused",
    "AsyncInbox",
    "AsyncMemoryStore",
    "AsyncPurgeService",
    "AsyncSQLiteStore",
    "AsyncStore",
    "AsyncTransactionalStore",
    "BrokerError",
    "BrokerUnavailable",
    "BusinessKey",
    "ClaimEnded",
    "Claimed",
    "Clock",
    "CloudEventsKey",
    "Codec",
    "CommitRefused",
    "ConfigurationError",
    "CorrelationIdKey",
    "Current",
    "Envelope",
    "Escalated",
    "FakeClock",
    "Fingerprint",
    "Fingerprinter",
    "FirstOf",
    "Handled",
    "HandlerRefused",
    "HeaderKey",
    "Hook",
    "InFlight",
    "Inbox",
    "InvalidIdentifier",
    "InvalidKey",
    "JSONCodec",
    "KeyConflict",
    "KeySource",
    "KeyTaken",
    "KeyTooLong",
    "KeyWarning",
    "Lease",
    "LeaseLost",
    "Limits",
    "MemoryStore",
    "MessageIdKey",
    "MissingKey",
    "OnStale",
    "OncelyError",
    "Outcome",
    "OutcomeError",
    "PayloadError",
    "PurgeRun",
    "PurgeService",
    "RawCodec",
    "Record",
    "RedeliveryHorizon",
    "Reject",
    "Rejected",
    "Resolution",
    "ResolveRefused",
    "Resolved",
    "ResultTooLarge",
    "ResultUnavailable",
    "Retention",
    "RetentionTooShort",
    "SQLiteSettings",
    "SQLiteStore",
    "SchemaError",
    "SchemaMissing",
    "SchemaOutdated",
    "SchemaTooNew",
    "StaleClaim",
    "Status",
    "Store",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "SystemClock",
    "TransactionEnded",
    "TransactionRequired",
    "TransactionalStore",
    "TransactionsUnsupported",
    "UndecodableBody",
    "UnfingerprintablePayload",
    "__version__",
    "canonical_json",
    "current",
    "fingerprint",
    "format_duration",
    "handling",
    "open",
    "open_async",
    "redact",
]
