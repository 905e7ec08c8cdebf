"""The closed set of outcomes, what each asks of the broker, and the value every call returns.

=================  ==========================================================  ===============
outcome            meaning                                                     broker action
=================  ==========================================================  ===============
processed          the handler ran and its effects are recorded                ack
duplicate          already processed; the first result is returned (R1)        ack
in_flight          another worker holds a live claim (R8, R10)                 requeue later
key_conflict       same key, different content (R20 step 6)                    dead-letter
stale_reclaimed    a lapsed claim was taken over and the handler ran (R10)     ack
escalated          a lapsed claim needs a person (R10)                         park
failed             the handler raised; the claim was released (R7, R10)        retry
rejected           poison, no usable key, or failed for good before            dead-letter
=================  ==========================================================  ===============

Adapters map outcomes to broker actions and decide nothing else. ``in_flight`` is never
acknowledged (the other worker may still fail); ``key_conflict`` is never acknowledged as a
duplicate (that would drop a message with different content silently).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, NoReturn, TypeVar

from oncely._core.fast import frozen_builder
from oncely._core.records import Record
from oncely.errors import Escalated, InFlight, KeyConflict, OutcomeError, Rejected

__all__ = ["Action", "Handled", "Outcome", "Released", "new_handled"]

R = TypeVar("R")


class Released(Exception):
    """The error of a ``failed`` outcome whose claim its caller gave back (``release``, an
    HTTP response not kept): the reason it gave, not something a handler raised, so it is
    logged without a traceback."""


class Action(StrEnum):
    """What a broker adapter does with the delivery."""

    ACK = "ack"
    REQUEUE_LATER = "requeue_later"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    PARK = "park"


class Outcome(StrEnum):
    """What happened to one delivery. See the module docstring for the table."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    IN_FLIGHT = "in_flight"
    KEY_CONFLICT = "key_conflict"
    STALE_RECLAIMED = "stale_reclaimed"
    ESCALATED = "escalated"
    FAILED = "failed"
    REJECTED = "rejected"

    @property
    def action(self) -> Action:
        return _ACTIONS[self]

    @property
    def log_level(self) -> int:
        return _LEVELS[self]


_ACTIONS = {
    Outcome.PROCESSED: Action.ACK,
    Outcome.DUPLICATE: Action.ACK,
    Outcome.IN_FLIGHT: Action.REQUEUE_LATER,
    Outcome.KEY_CONFLICT: Action.DEAD_LETTER,
    Outcome.STALE_RECLAIMED: Action.ACK,
    Outcome.ESCALATED: Action.PARK,
    Outcome.FAILED: Action.RETRY,
    Outcome.REJECTED: Action.DEAD_LETTER,
}

_LEVELS = {
    Outcome.PROCESSED: logging.INFO,
    Outcome.DUPLICATE: logging.INFO,
    Outcome.IN_FLIGHT: logging.INFO,
    Outcome.KEY_CONFLICT: logging.ERROR,
    Outcome.STALE_RECLAIMED: logging.WARNING,
    Outcome.ESCALATED: logging.ERROR,
    Outcome.FAILED: logging.WARNING,
    Outcome.REJECTED: logging.ERROR,
}


@dataclass(frozen=True, slots=True)
class Handled(Generic[R]):
    """The outcome of one delivery, with what a caller, a log line or a metric needs.

    ``value`` is the handler's result (``processed``, ``stale_reclaimed``) or the result stored
    the first time (``duplicate``), as its codec decodes it: with the default JSON codec a
    ``Decimal`` comes back as its string, ``bytes`` as base64 text, a tuple as a list.
    ``idempotent``, ``run_once`` and the task and FastStream integrations rebuild it as the
    function's return annotation; ``Inbox.handle`` gives it as decoded. ``reason`` explains
    every outcome other than processed and duplicate; ``error`` is the handler's exception for
    ``failed``. ``key`` is ``None`` only when the message was rejected for having no usable
    key. ``attempt`` is the claim's attempt number
    (1 for the first claim of the key; 0 when no claim was made); ``record`` is the record as the
    store holds it now, which after a lost lease belongs to the new owner.

    A Handled pickles and copies (every protocol) with its record and its error: oncely's own
    exceptions all do, a handler's exception must too. Equality is field by field, and
    ``error`` is an exception, which compares by identity: a Handled that carries an error
    equals its unpickled copy in every other field (``dataclasses.replace(h, error=None)``),
    and the two errors have the same type and ``args``. Without an error, the copy is ``==``.
    """

    outcome: Outcome
    consumer: str
    key: str | None
    value: R | None = None
    reason: str | None = None
    error: BaseException | None = None
    record: Record | None = None
    attempt: int = 0
    duration_s: float = 0.0
    correlation_id: str | None = None

    @property
    def action(self) -> Action:
        """What the broker should do with this delivery."""
        return _ACTIONS[self.outcome]

    @property
    def log_level(self) -> int:
        """The level this outcome is logged at: its outcome's (ERROR for what a person must
        see), or WARNING for an acknowledged one that carries a reason (processed, but the
        result could not be stored, or a duplicate whose stored result cannot be read)."""
        # Keyed by the outcome's text: an enum member hashes through a Python-level __hash__,
        # a str through its cached hash, and this runs for every message that is logged.
        outcome = self.outcome._value_
        if self.reason is not None and outcome in _NOTED:
            return logging.WARNING
        return _LEVEL_OF[outcome]

    @property
    def ok(self) -> bool:
        """True when the message's effect exists (processed, duplicate, stale_reclaimed)."""
        return self.outcome in _DONE

    def unwrap(self) -> R | None:
        """The value, or the exception a plain function call should raise instead.

        ``failed`` re-raises the handler's own exception; the other non-success outcomes raise
        :class:`~oncely.InFlight`, :class:`~oncely.KeyConflict`, :class:`~oncely.Escalated` or
        :class:`~oncely.Rejected`, each carrying this value as ``.handled``.
        """
        if self.outcome in _DONE:
            return self.value
        self._raise()

    def _raise(self) -> NoReturn:
        text = f"{self.outcome} for key {self.key!r} (consumer {self.consumer!r})"
        if self.reason:
            text += f": {self.reason}"
        if self.outcome is Outcome.FAILED:
            if self.error is not None:
                raise self.error
            raise OutcomeError(text, self)  # type: ignore[arg-type]
        handled: Handled[object] = self  # type: ignore[assignment]
        if self.outcome is Outcome.IN_FLIGHT:
            raise InFlight(text, handled)
        if self.outcome is Outcome.KEY_CONFLICT:
            raise KeyConflict(text, handled)
        if self.outcome is Outcome.ESCALATED:
            raise Escalated(text, handled)
        raise Rejected(text, handled)


_DONE = frozenset({Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.STALE_RECLAIMED})
_NOTED = frozenset({Outcome.PROCESSED.value, Outcome.DUPLICATE.value})
_LEVEL_OF = {outcome.value: level for outcome, level in _LEVELS.items()}


if TYPE_CHECKING:

    def new_handled(
        outcome: Outcome,
        consumer: str,
        key: str | None,
        value: R | None,
        reason: str | None,
        error: BaseException | None,
        record: Record | None,
        attempt: int,
        duration_s: float,
        correlation_id: str | None,
    ) -> Handled[R]:
        """``Handled(...)`` with every field given, for the inbox's hot path, once per message
        (speed: see :mod:`oncely._core.fast`)."""

else:
    new_handled = frozen_builder(Handled)
