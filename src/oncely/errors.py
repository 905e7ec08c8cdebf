"""Every exception oncely raises, in one tree.

::

    OncelyError
    ├── ConfigurationError             a policy or name that cannot work; fix the code
    │   ├── RetentionTooShort          retention below the declared redelivery horizon (R13)
    │   └── InvalidIdentifier          a table or schema name that is not a plain identifier
    ├── InvalidKey                     no usable dedup key on a message (R2-R4)
    │   ├── MissingKey                 the key source found nothing
    │   └── KeyTooLong                 over the configured size limit
    ├── PayloadError                   a payload or result oncely cannot handle
    │   ├── UnfingerprintablePayload   a value the canonical fingerprint cannot encode
    │   ├── ResultTooLarge             an encoded result over the configured size limit
    │   └── UndecodableBody            a message body the consumer's decoder cannot read
    ├── StoreError                     the dedup store failed; no driver exception escapes
    │   ├── StoreUnavailable           cannot reach or lock the store now; retry later
    │   ├── SchemaError                tables missing or of an unknown version
    │   │   ├── SchemaMissing          run ``oncely migrate``
    │   │   ├── SchemaOutdated         an older revision this oncely needs migrated (online)
    │   │   └── SchemaTooNew           written by a newer oncely; upgrade
    │   ├── TransactionRequired        transactional mode outside an open transaction
    │   ├── CommitRefused              the commit refused the handler's writes; nothing kept
    │   │   └── KeyTaken               another worker recorded the key first (DynamoDB)
    │   └── TransactionsUnsupported    the store cannot join a caller's transaction
    ├── BrokerError                    a broker adapter failed; driver exceptions are wrapped
    │   └── BrokerUnavailable          cannot reach the broker now; the adapter reconnects
    ├── LeaseLost                      a fenced write found another owner (or nothing)
    ├── ResolveRefused                 an operator's resolve that the record's state forbids
    ├── Reject                         raised BY A HANDLER: the message is poison (R20.6)
    └── OutcomeError                   raised by the call-style API for a non-success outcome
        ├── InFlight                   another worker holds a live claim on the key
        ├── KeyConflict                same key, different payload (R20 step 6)
        ├── Escalated                  a stale claim was parked for a person (R10)
        └── Rejected                   the message was refused (poison, failed before)

Expected outcomes of processing (a duplicate, a conflict, a message in flight elsewhere) are
*values* (:class:`oncely.Handled`), never exceptions, on the message path. The call-style API
(:meth:`oncely.Inbox.idempotent`) turns them into :class:`OutcomeError` subclasses because a plain
function call has no other way to say "not processed".

Every exception in the tree pickles (any protocol) and copies to the same type with the same
``args``, text and attributes (``LeaseLost.current``, ``Reject.reason``, ``OutcomeError.handled``,
notes), so one raised in a ``ProcessPoolExecutor`` worker, a ``multiprocessing`` pool or a Celery
task (pickle serializer) reaches the parent as itself. See :meth:`OncelyError.__reduce__`.
"""

from __future__ import annotations

import copyreg
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oncely._core.outcomes import Handled
    from oncely._core.records import Record

__all__ = [
    "AsyncHandlerRefused",
    "BrokerError",
    "BrokerUnavailable",
    "ClaimEnded",
    "CommitRefused",
    "ConfigurationError",
    "Escalated",
    "HandlerRefused",
    "InFlight",
    "InvalidIdentifier",
    "InvalidKey",
    "KeyConflict",
    "KeyTaken",
    "KeyTooLong",
    "LeaseLost",
    "MissingKey",
    "OncelyError",
    "OutcomeError",
    "PayloadError",
    "Reject",
    "Rejected",
    "ResolveRefused",
    "ResultTooLarge",
    "ResultUnavailable",
    "RetentionTooShort",
    "SchemaError",
    "SchemaMissing",
    "SchemaOutdated",
    "SchemaTooNew",
    "StoreError",
    "StoreUnavailable",
    "TransactionEnded",
    "TransactionRequired",
    "TransactionsUnsupported",
    "UndecodableBody",
    "UnfingerprintablePayload",
]


# ``copyreg.__newobj__(cls, *args)`` is ``cls.__new__(cls, *args)``; pickle writes it as the
# NEWOBJ opcode (protocols 2+), so no oncely name is stored in the pickle. typeshed omits it.
_NEWOBJ: Any = copyreg.__newobj__  # type: ignore[attr-defined]


class OncelyError(Exception):
    """Base class of every exception oncely raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and copy) as ``args`` plus the instance's attributes, not as ``cls(*args)``.

        ``BaseException.__reduce__`` rebuilds an exception by calling ``cls(*self.args)``, which
        fails for every class whose ``__init__`` takes other arguments than it passes on as
        ``args`` (``OutcomeError(message, handled)``, ``LeaseLost(message, current)``): the
        unpickling raised ``TypeError``, which breaks a process pool. Here the copy is made with
        ``cls.__new__(cls, *args)`` (``__init__`` is not called again) and gets the original's
        ``__dict__`` back, so every subclass, present or future, round-trips whatever its
        constructor's signature, with the same ``args`` and ``str()``. Attributes are restored
        after the object exists, so a cycle through them (``handled.error is self``) pickles too.
        As for any exception, ``__traceback__``, ``__cause__`` and ``__context__`` are not kept.
        """
        return (_NEWOBJ, (type(self), *self.args), self.__dict__ or None)


class ConfigurationError(OncelyError, ValueError):
    """A configuration that cannot keep oncely's guarantees. Raised at construction time."""


class HandlerRefused(ConfigurationError, TypeError):
    """A handler whose call runs nothing the inbox could record as done: a generator function
    (calling it returns a generator and runs none of its body), or an async one given to a
    sync :class:`~oncely.Inbox` (:class:`AsyncHandlerRefused`). Raised before the key is
    claimed, or once such an object comes back from the call (the claim released, nothing
    recorded); :meth:`Claimed.complete <oncely.Claimed.complete>` refuses one as a result
    too. Return a value (``list(...)`` of a generator's items), or await the coroutine."""


class AsyncHandlerRefused(HandlerRefused):
    """A sync :class:`~oncely.Inbox` was given an async handler (an ``async def``, or a
    function that returned an awaitable): it has no event loop to run it on, so the handler
    would never run while its key was recorded as done. Raised before the key is claimed
    (for an ``async def``) or once the awaitable comes back (the claim released, nothing
    recorded). Use :class:`~oncely.AsyncInbox`, or give the sync inbox a plain function."""


class RetentionTooShort(ConfigurationError):
    """Retention is shorter than the redelivery horizon the broker was declared to have (R13).

    Deleting a record before the broker has stopped redelivering the message reopens the door to
    duplicates, so oncely refuses the configuration instead of failing silently later.
    """


class InvalidIdentifier(ConfigurationError):
    """A table, schema or consumer name that is not safe to use."""


class InvalidKey(OncelyError, ValueError):
    """The message has no usable dedup key (R2-R4). The message is rejected, never processed."""


class MissingKey(InvalidKey):
    """The configured key source found no key on the message."""


class KeyTooLong(InvalidKey):
    """The key is longer than the configured limit."""


class PayloadError(OncelyError, ValueError):
    """A payload or result that oncely cannot fingerprint, encode or store."""


class UnfingerprintablePayload(PayloadError):
    """The payload holds a value with no canonical encoding (a set of mixed types, an object)."""


class ResultTooLarge(PayloadError):
    """The handler's encoded result is larger than the configured limit."""


class UndecodableBody(PayloadError):
    """A broker message's body cannot be decoded (not JSON, not UTF-8 text, or a decoder
    refused it). The consumer rejects the message and dead-letters it with the reason."""


class StoreError(OncelyError):
    """The dedup store failed. Driver exceptions are translated into this tree at the boundary."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or stayed locked past its timeout. Retrying later is safe:
    nothing was acknowledged and no record was written on oncely's behalf."""


class SchemaError(StoreError):
    """The store's tables are missing or were written by an incompatible version."""


class SchemaMissing(SchemaError):
    """The tables do not exist. Run ``oncely migrate --store URL`` (or open with migrate=True)."""


class SchemaOutdated(SchemaError):
    """The tables are of an older revision than this oncely needs. Run ``oncely migrate
    --store URL``: the migration is online, and workers of the older oncely keep working on
    the migrated tables."""


class SchemaTooNew(SchemaError):
    """The tables were created by a newer oncely than this one; upgrade oncely to use them."""


class TransactionRequired(StoreError):
    """Transactional mode was asked to join a connection that has no open transaction."""


class TransactionEnded(TransactionRequired):
    """A transactional handler committed or rolled back the transaction it was given: its
    writes and the key's marker no longer commit together (what it committed stays; the rest
    is rolled back, the result not stored). A handler writes; oncely or its caller commits."""


class CommitRefused(StoreError):
    """The COMMIT of oncely's own transaction refused what the block wrote: a constraint
    checked only at commit (PostgreSQL's ``DEFERRABLE INITIALLY DEFERRED``, SQLite's
    deferred foreign keys) that a handler's write broke. Nothing committed. In
    :meth:`Inbox.handle_in_transaction <oncely.Inbox.handle_in_transaction>` it is the
    handler's failure: the outcome is ``failed``, not this error."""


class KeyTaken(CommitRefused):
    """The commit of a DynamoDB transaction was refused because another worker recorded one of
    its keys first (the marker's condition failed): nothing of the transaction was written. In
    :meth:`Inbox.handle_in_transaction <oncely.Inbox.handle_in_transaction>` (oncely's own
    transaction) the key is claimed again once, and the winner's record answers (a
    ``duplicate`` with its result, or ``in_flight``); a transaction of yours raises it at its
    end, and a redelivery is then answered the same way."""


class TransactionsUnsupported(StoreError):
    """This store cannot join a caller's transaction (Redis, memory). Use the two-phase mode."""


class BrokerError(OncelyError):
    """A broker adapter failed. Broker client exceptions are translated into this tree."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached now. Nothing was acknowledged; the adapter reconnects and
    the broker redelivers whatever was not settled."""


class LeaseLost(OncelyError):
    """A fenced write (complete, renew, release, fail) carried a token that no longer owns the
    record: another worker took it over after the lease expired, or the record is gone.

    Nothing was changed. ``current`` is the record as the store holds it now (``None`` if absent).
    """

    def __init__(self, message: str, current: Record | None) -> None:
        super().__init__(message)
        self.current = current


class ClaimEnded(OncelyError):
    """An ending (``complete``, ``release``, ``reject``, ``renew``) was asked of a claim from
    :meth:`~oncely.AsyncInbox.claim` that was not won (``handled`` says why) or has ended
    already. Nothing was changed."""


class ResolveRefused(OncelyError):
    """:meth:`~oncely.AsyncInbox.resolve` changed nothing: a live claim holds the record (an
    operator never overrides a running worker), the record is already settled that way, or
    there is nothing to retry. ``current`` is the record as the store holds it (``None`` if
    absent)."""

    def __init__(self, message: str, current: Record | None) -> None:
        super().__init__(message)
        self.current = current


class Reject(OncelyError):
    """Raise from a handler to refuse a poison message for good.

    oncely records the key as ``failed`` with ``reason`` and returns the ``rejected`` outcome, so
    the adapter dead-letters it; redeliveries of the same key are rejected again without running
    the handler. Any other exception is treated as transient (the claim is released and a
    redelivery retries).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OutcomeError(OncelyError):
    """The call-style API could not return a result. ``handled`` carries the full outcome."""

    def __init__(self, message: str, handled: Handled[object]) -> None:
        super().__init__(message)
        self.handled = handled


class InFlight(OutcomeError):
    """Another worker holds a live claim on this key. Retry later for its result."""


class KeyConflict(OutcomeError):
    """The key was already used for a different payload (fingerprints differ)."""


class Escalated(OutcomeError):
    """A stale claim could not be resolved automatically and was parked for a person."""


class Rejected(OutcomeError):
    """The message was refused: it has no usable key, or it failed for good before."""


class ResultUnavailable(OutcomeError):
    """A repeat of a call that ran: its first result was not kept (over
    ``max_result_bytes``, or not encodable, or it is another's: a Celery task that replaced
    itself) or cannot be decoded, so there is nothing to return. The call is not run again;
    ``handled.reason`` says why."""
