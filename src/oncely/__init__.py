"""oncely: effectively-once message processing on top of at-least-once delivery.

The public API lives here and nowhere else; every name below is stable. Start with
:class:`Inbox` (or :class:`AsyncInbox`) on a store from :func:`open`::

    import oncely

    inbox = oncely.Inbox(oncely.open("sqlite:///oncely.db"), consumer="billing")
    handled = inbox.handle(message_id, payment, charge)   # two-phase mode (R10)
    handled = inbox.handle_in_transaction(message_id, payment, book)  # transactional (R7)
    if handled.outcome is oncely.Outcome.KEY_CONFLICT: ...
"""

from typing import TYPE_CHECKING

from oncely._async.inbox import AsyncInbox
from oncely._async.memory import AsyncMemoryStore
from oncely._async.protocols import AsyncStore, AsyncTransactionalStore
from oncely._async.sqlite import AsyncSQLiteStore
from oncely._core.clock import Clock, FakeClock, SystemClock
from oncely._core.codec import Codec, JSONCodec, RawCodec
from oncely._core.context import Current, current
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
    Retention,
    StaleClaim,
    format_duration,
)
from oncely._core.records import Claim, ClaimRequest, ClaimStatus, Record, Status, StoreStats
from oncely._drivers.sqlite import SQLiteSettings
from oncely._sync.inbox import Inbox
from oncely._sync.memory import MemoryStore
from oncely._sync.protocols import Store, TransactionalStore
from oncely._sync.sqlite import SQLiteStore
from oncely.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    Escalated,
    InFlight,
    InvalidIdentifier,
    InvalidKey,
    KeyConflict,
    KeyTooLong,
    LeaseLost,
    MissingKey,
    OncelyError,
    OutcomeError,
    PayloadError,
    Reject,
    Rejected,
    ResultTooLarge,
    RetentionTooShort,
    SchemaError,
    SchemaMissing,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    TransactionRequired,
    TransactionsUnsupported,
    UnfingerprintablePayload,
)
from oncely.stores import open_async_store as open_async
from oncely.stores import open_store as open  # noqa: A004 - `oncely.open(url)` mirrors the URL API
from oncely.stores import redact

__version__ = "0.1.0"

if TYPE_CHECKING:  # the optional stores, for type checkers; imported lazily at run time
    from oncely._async.mysql import AsyncMySQLStore as AsyncMySQLStore
    from oncely._async.postgres import AsyncPostgresStore as AsyncPostgresStore
    from oncely._async.redis import AsyncRedisStore as AsyncRedisStore
    from oncely._sync.mysql import MySQLStore as MySQLStore
    from oncely._sync.postgres import PostgresStore as PostgresStore
    from oncely._sync.redis import RedisStore as RedisStore

# Stores whose drivers are optional extras are imported on first use, so `import oncely` never
# needs psycopg, PyMySQL or redis-py: `oncely.PostgresStore` works once `oncely[postgres]` is in.
_OPTIONAL = {
    "PostgresStore": ("oncely._sync.postgres", "postgres"),
    "AsyncPostgresStore": ("oncely._async.postgres", "postgres"),
    "MySQLStore": ("oncely._sync.mysql", "mysql"),
    "AsyncMySQLStore": ("oncely._async.mysql", "mysql"),
    "RedisStore": ("oncely._sync.redis", "redis"),
    "AsyncRedisStore": ("oncely._async.redis", "redis"),
}


def __getattr__(name: str) -> object:
    if name not in _OPTIONAL:
        raise AttributeError(f"module 'oncely' has no attribute {name!r}")
    module_name, extra = _OPTIONAL[name]
    try:
        module = __import__(module_name, fromlist=[name])
    except ModuleNotFoundError as exc:
        raise ImportError(
            f"oncely.{name} needs the {exc.name!r} package: pip install 'oncely[{extra}]'"
        ) from exc
    return getattr(module, name)


__all__ = [
    "Action",
    "AsyncInbox",
    "AsyncMemoryStore",
    "AsyncSQLiteStore",
    "AsyncStore",
    "AsyncTransactionalStore",
    "BrokerError",
    "BrokerUnavailable",
    "BusinessKey",
    "Claim",
    "ClaimRequest",
    "ClaimStatus",
    "Clock",
    "CloudEventsKey",
    "Codec",
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
    "HeaderKey",
    "Hook",
    "InFlight",
    "Inbox",
    "InvalidIdentifier",
    "InvalidKey",
    "JSONCodec",
    "KeyConflict",
    "KeySource",
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
    "RawCodec",
    "Record",
    "RedeliveryHorizon",
    "Reject",
    "Rejected",
    "Resolution",
    "ResultTooLarge",
    "Retention",
    "RetentionTooShort",
    "SQLiteSettings",
    "SQLiteStore",
    "SchemaError",
    "SchemaMissing",
    "SchemaTooNew",
    "StaleClaim",
    "Status",
    "Store",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "SystemClock",
    "TransactionRequired",
    "TransactionalStore",
    "TransactionsUnsupported",
    "UnfingerprintablePayload",
    "__version__",
    "canonical_json",
    "current",
    "fingerprint",
    "format_duration",
    "open",
    "open_async",
    "redact",
]
