"""What a create of the entity marker comes to: :class:`EntityOutcome` and :class:`EntityResult`.

Plain values without SQLAlchemy: the outcome of one create (R20 steps 5 and 6), the row it is
about, and its translation into the :class:`oncely.Handled` that adapters, logs and metrics take.
:mod:`oncely.integrations.entity` exports them; :mod:`oncely.integrations.entity._flow` makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from oncely._core.fingerprint import canonical_json
from oncely._core.outcomes import Action, Handled, Outcome

__all__ = ["EntityOutcome", "EntityResult"]


class EntityOutcome(StrEnum):
    """What became of one create: ``created``, ``duplicate`` or ``key_conflict``.

    =============  =====================  =================================================
    outcome        :class:`oncely.Outcome`  broker action
    =============  =====================  =================================================
    created        processed              ack: the row (the marker) is new
    duplicate      duplicate              ack: the same content was created before (R20.5)
    key_conflict   key_conflict           dead-letter + alert, never a silent ack (R20.6)
    =============  =====================  =================================================
    """

    CREATED = "created"
    DUPLICATE = "duplicate"
    KEY_CONFLICT = "key_conflict"

    @property
    def as_outcome(self) -> Outcome:
        """The :class:`oncely.Outcome` a broker adapter acts on."""
        return _AS_OUTCOME[self]

    @property
    def action(self) -> Action:
        """What the broker should do with the delivery."""
        return _AS_OUTCOME[self].action


_AS_OUTCOME: Final = {
    EntityOutcome.CREATED: Outcome.PROCESSED,
    EntityOutcome.DUPLICATE: Outcome.DUPLICATE,
    EntityOutcome.KEY_CONFLICT: Outcome.KEY_CONFLICT,
}


@dataclass(frozen=True, slots=True)
class EntityResult:
    """The result of :func:`~oncely.integrations.entity.create_once` and its kin.

    ``row`` is the row as the database holds it (for ``created``: as inserted, with server
    defaults; otherwise the first copy's row), keyed by the names the caller used (column keys,
    or attribute names of an ORM class). ``differing`` names the compared fields whose stored
    value differs (``key_conflict`` only); ``reason`` says why in one line that names fields,
    never values of the payload.
    """

    outcome: EntityOutcome
    key: Mapping[str, object]
    row: Mapping[str, object]
    differing: tuple[str, ...] = ()
    reason: str | None = None

    @property
    def action(self) -> Action:
        """What the broker should do with the delivery (ack, or dead-letter on a conflict)."""
        return self.outcome.action

    def handled(self, consumer: str) -> Handled[Mapping[str, object]]:
        """This result as the :class:`oncely.Handled` every adapter, log line and metric takes.

        The key is the key's single value as text, or canonical JSON for a composite key.
        """
        key = next(iter(self.key.values())) if len(self.key) == 1 else self.key
        return Handled(
            outcome=self.outcome.as_outcome,
            consumer=consumer,
            key=key if isinstance(key, str) else canonical_json(key),
            value=None if self.outcome is EntityOutcome.KEY_CONFLICT else self.row,
            reason=self.reason,
            attempt=1 if self.outcome is EntityOutcome.CREATED else 0,
        )
