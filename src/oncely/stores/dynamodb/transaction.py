"""The DynamoDB store's transaction: the writes of a block, buffered, sent as one
``TransactWriteItems`` with the inbox's marker when the block ends.

DynamoDB has no transaction to open and write in: a ``TransactWriteItems`` call carries every
write at once and applies all of them or none. So :class:`DynamoTransaction` buffers; the
store (:meth:`AsyncDynamoDBStore.transaction
<oncely.stores.dynamodb.async_store.AsyncDynamoDBStore.transaction>`) sends it when the block
ends and sends nothing when it raises. Buffering needs no I/O, so one class serves the threaded
and the asyncio store.

DynamoDB's limits on one call are checked as each write is added, before anything is sent:
at most 100 actions (the marker is one), about 4 MB in all, one action per item; and no write
of yours in the inbox's own table (its items are oncely's records).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from oncely._core.records import Record
from oncely.errors import ConfigurationError, TransactionRequired
from oncely.stores.dynamodb.dialect import Item

__all__ = ["DynamoTransaction"]

MAX_ACTIONS: Final = 100
"""DynamoDB's limit on the actions of one ``TransactWriteItems``."""
MAX_BYTES: Final = 4 * 1024 * 1024
"""DynamoDB's limit on the items of one ``TransactWriteItems`` (4 MB)."""
_KINDS: Final = ("Put", "Update", "Delete", "ConditionCheck")

Action = dict[str, Any]
"""One entry of ``TransactItems``: ``{"Put": {...}}``, ``{"Update": {...}}``,
``{"Delete": {...}}`` or ``{"ConditionCheck": {...}}``, in botocore's shape."""


@dataclass(slots=True)
class Marker:
    """The inbox's marker that an action of the transaction puts: its record and revision."""

    table: str
    pk: str
    rev: str
    record: Record


@dataclass(slots=True)
class Offsets:
    """The stored offsets item of one consumer and stream that an action of the transaction
    moves forward: its partitions as read, and those the transaction moves."""

    pk: str
    read: dict[int, int]
    moved: dict[int, int]

    def body(self, table: str) -> dict[str, Any]:
        """The ``Update`` that sets the moved partitions, conditional on each being still as
        read (a write of another transaction meanwhile cancels this one: never moved back)."""
        sets, checks = [], []
        names: dict[str, str] = {}
        values: dict[str, Any] = {}
        for i, (part, offset) in enumerate(sorted(self.moved.items())):
            names[f"#p{i}"] = f"p{part}"
            values[f":v{i}"] = {"N": str(offset)}
            sets.append(f"#p{i} = :v{i}")
            if part in self.read:
                values[f":r{i}"] = {"N": str(self.read[part])}
                checks.append(f"#p{i} = :r{i}")
            else:
                checks.append(f"attribute_not_exists(#p{i})")
        return {
            "TableName": table,
            "Key": {"pk": {"S": self.pk}},
            "UpdateExpression": "SET " + ", ".join(sets),
            "ConditionExpression": " AND ".join(checks),
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }


Mark = tuple[int, dict[str, dict[int, int]]]
"""What a savepoint restores: the number of actions, and the offsets each moved then."""


def value_bytes(value: Any) -> int:
    """About how many bytes DynamoDB counts for a typed AttributeValue."""
    if not isinstance(value, Mapping) or len(value) != 1:
        return 1
    ((kind, inner),) = value.items()
    if kind == "S":
        return len(str(inner).encode("utf-8", "surrogatepass"))
    if kind == "N":
        return len(str(inner)) // 2 + 1
    if kind == "B":
        return len(inner) if isinstance(inner, bytes | bytearray) else len(str(inner))
    if kind in ("SS", "NS", "BS"):
        return sum(value_bytes({kind[0]: v}) for v in inner)
    if kind == "L":
        return 3 + sum(1 + value_bytes(v) for v in inner)
    if kind == "M":
        return 3 + item_bytes(inner)
    return 1  # BOOL, NULL


def item_bytes(item: Mapping[str, Any]) -> int:
    """About how many bytes DynamoDB counts for an item (names and values)."""
    return sum(
        len(name.encode("utf-8", "surrogatepass")) + value_bytes(v) for name, v in item.items()
    )


def _action_bytes(body: Mapping[str, Any]) -> int:
    size = 0
    for part in ("Item", "Key", "ExpressionAttributeValues"):
        if part in body:
            size += item_bytes(body[part])
    for part in ("ConditionExpression", "UpdateExpression"):
        size += len(str(body.get(part, "")))
    return size


def _identity(table: str, key: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return table, tuple(sorted((name, repr(sorted(v.items()))) for name, v in key.items()))


class DynamoTransaction:
    """The writes of one ``async with store.transaction() as tx`` block (``with`` for the
    threaded store), committed as ONE ``TransactWriteItems`` with the inbox's marker when the
    block ends; nothing is sent when it raises.

    A handler of :meth:`Inbox.handle_in_transaction <oncely.Inbox.handle_in_transaction>`
    receives it as ``tx`` and adds its writes with :meth:`put`, :meth:`update`,
    :meth:`delete` and :meth:`condition_check` (or :meth:`add`, an action of
    ``TransactItems`` as botocore's low-level client takes it), in DynamoDB's typed
    AttributeValues (``{"S": "text"}``, ``{"N": "12"}``). They are only buffered: nothing is
    written until the block ends, and nothing can be read back from it. A condition of yours
    that fails at the commit fails the whole transaction, the marker with it: the handler's
    failure (:class:`~oncely.CommitRefused`), retried.

    Refused as they are added (:class:`~oncely.ConfigurationError`): more than 100 actions
    (DynamoDB's limit; the marker is one of them), more than about 4 MB, two actions on one
    item, and any write in the inbox's own table.
    """

    __slots__ = (
        "_actions",
        "_ended",
        "_ids",
        "_inbox_table",
        "_markers",
        "_offsets",
        "_owner",
        "_sizes",
    )

    def __init__(self, owner: tuple[str | None, str], inbox_table: str) -> None:
        self._owner = owner
        self._inbox_table = inbox_table
        self._actions: list[Action] = []
        self._sizes: list[int] = []
        # The item each action writes, where its key is known (a Put's is read from the
        # table's key schema at the commit).
        self._ids: list[tuple[str, tuple[tuple[str, str], ...]] | None] = []
        self._markers: list[Marker | None] = []
        # The stored offsets items moved (by their partition key), and the action of each.
        self._offsets: dict[str, tuple[int, Offsets]] = {}
        self._ended = False

    def __repr__(self) -> str:
        state = "ended" if self._ended else "open"
        return f"<DynamoTransaction {state}, {len(self._actions)} action(s)>"

    def __len__(self) -> int:
        return len(self._actions)

    @property
    def ended(self) -> bool:
        """Whether the block ended (committed, or rolled back by its exception)."""
        return self._ended

    @property
    def actions(self) -> list[Action]:
        """The buffered actions, in order, as ``TransactItems`` takes them (a copy)."""
        return list(self._actions)

    # ------------------------------------------------------------ your writes

    def put(
        self,
        table: str,
        item: Item,
        *,
        condition: str | None = None,
        names: Mapping[str, str] | None = None,
        values: Item | None = None,
    ) -> None:
        """Put ``item`` in ``table`` (a ``Put`` action), if ``condition`` holds."""
        body: dict[str, Any] = {"TableName": table, "Item": item}
        self.add({"Put": _expressions(body, condition, names, values)})

    def update(
        self,
        table: str,
        key: Item,
        update: str,
        *,
        condition: str | None = None,
        names: Mapping[str, str] | None = None,
        values: Item | None = None,
    ) -> None:
        """Update the item of ``key`` in ``table`` by the expression ``update`` (``"ADD n
        :one"``), if ``condition`` holds."""
        body: dict[str, Any] = {"TableName": table, "Key": key, "UpdateExpression": update}
        self.add({"Update": _expressions(body, condition, names, values)})

    def delete(
        self,
        table: str,
        key: Item,
        *,
        condition: str | None = None,
        names: Mapping[str, str] | None = None,
        values: Item | None = None,
    ) -> None:
        """Delete the item of ``key`` in ``table``, if ``condition`` holds."""
        body: dict[str, Any] = {"TableName": table, "Key": key}
        self.add({"Delete": _expressions(body, condition, names, values)})

    def condition_check(
        self,
        table: str,
        key: Item,
        condition: str,
        *,
        names: Mapping[str, str] | None = None,
        values: Item | None = None,
    ) -> None:
        """Commit only if ``condition`` holds for the item of ``key`` in ``table`` (which is
        not written)."""
        body: dict[str, Any] = {"TableName": table, "Key": key}
        self.add({"ConditionCheck": _expressions(body, condition, names, values)})

    def add(self, action: Action) -> None:
        """Add one action of ``TransactItems`` as botocore takes it (``{"Put": {"TableName":
        ..., "Item": ...}}``, ``Update``, ``Delete`` or ``ConditionCheck``)."""
        body = _checked(action)
        if body["TableName"] == self._inbox_table:
            raise ConfigurationError(
                f"a write in the inbox's own table {self._inbox_table!r}: its items are "
                "oncely's records; keep your items in a table of your own"
            )
        self._append(action, body, None)

    # ------------------------------------------------------------ the store's side

    def _append(self, action: Action, body: Mapping[str, Any], marker: Marker | None) -> None:
        if self._ended:
            raise TransactionRequired(
                "the transaction has ended (committed or rolled back): write in the block of "
                "store.transaction() that yields it"
            )
        if len(self._actions) >= MAX_ACTIONS:
            raise ConfigurationError(
                f"a DynamoDB transaction holds at most {MAX_ACTIONS} actions "
                "(TransactWriteItems), the inbox's marker one of them"
            )
        size = _action_bytes(body)
        if sum(self._sizes) + size > MAX_BYTES:
            raise ConfigurationError(
                f"a DynamoDB transaction holds at most 4 MB (TransactWriteItems); this action "
                f"of about {size:,} bytes would take it to {sum(self._sizes) + size:,}"
            )
        ident = _identity(body["TableName"], body["Key"]) if "Key" in body else None
        if ident is not None and ident in self._ids:
            raise ConfigurationError(
                f"a second action on one item of table {body['TableName']!r} (key "
                f"{dict(body['Key'])!r}): DynamoDB takes one action per item in a transaction"
            )
        self._actions.append(action)
        self._sizes.append(size)
        self._ids.append(ident)
        self._markers.append(marker)

    def _identify(self, key_names: Mapping[str, Sequence[str] | None]) -> None:
        """Name the items the ``Put`` actions write from their tables' key attributes, and
        refuse a second action on one item (:class:`~oncely.ConfigurationError`). A table
        whose key attributes are not known (None) is left to DynamoDB's own check."""
        for i, action in enumerate(self._actions):
            if self._ids[i] is not None or "Put" not in action:
                continue
            body = action["Put"]
            names = key_names.get(body["TableName"])
            if names is None:
                continue
            ident = _identity(body["TableName"], {n: body["Item"].get(n, {}) for n in names})
            if ident in self._ids:
                raise ConfigurationError(
                    f"a second action on one item of table {body['TableName']!r}: DynamoDB "
                    "takes one action per item in a transaction"
                )
            self._ids[i] = ident

    def _marker(self, table: str, pk: str) -> tuple[int, Marker] | None:
        for i, marker in enumerate(self._markers):
            if marker is not None and marker.table == table and marker.pk == pk:
                return i, marker
        return None

    def _marker_at(self, index: int) -> Marker | None:
        return self._markers[index] if 0 <= index < len(self._markers) else None

    def _bytes_with(self, index: int, item: Item) -> int:
        """About how many bytes the transaction holds with the ``Put`` at ``index`` putting
        ``item`` instead."""
        body = {**self._actions[index]["Put"], "Item": item}
        return sum(self._sizes) - self._sizes[index] + _action_bytes(body)

    def _set_marker(self, index: int, item: Item, marker: Marker) -> None:
        self._actions[index]["Put"]["Item"] = item
        self._sizes[index] = _action_bytes(self._actions[index]["Put"])
        self._markers[index] = marker

    def _offsets_of(self, pk: str) -> Offsets | None:
        entry = self._offsets.get(pk)
        return None if entry is None else entry[1]

    def _is_offsets(self, index: int) -> bool:
        return any(i == index for i, _ in self._offsets.values())

    def _move(self, table: str, state: Offsets, part: int, next_offset: int) -> None:
        """Move ``part`` of the offsets item ``state`` to ``next_offset`` in this transaction,
        unless it is there or beyond already (as read, or as moved here)."""
        kept = state.moved.get(part, state.read.get(part))
        if kept is not None and next_offset <= kept:
            return
        moved = Offsets(state.pk, state.read, {**state.moved, part: next_offset})
        body = moved.body(table)
        entry = self._offsets.get(state.pk)
        if entry is None:
            self._append({"Update": body}, body, None)
            self._offsets[state.pk] = (len(self._actions) - 1, moved)
        else:  # one action per item: the partitions of one item move in one Update
            self._actions[entry[0]] = {"Update": body}
            self._sizes[entry[0]] = _action_bytes(body)
            self._offsets[state.pk] = (entry[0], moved)

    def _mark(self) -> Mark:
        return len(self._actions), {pk: dict(o.moved) for pk, (_, o) in self._offsets.items()}

    def _restore(self, mark: Mark) -> None:
        """Forget what was added since ``mark`` (a savepoint's rollback): the actions added
        after it, and the partitions moved since in an offsets item's action added before."""
        length, moved = mark
        del self._actions[length:], self._sizes[length:], self._ids[length:]
        del self._markers[length:]
        for pk, (index, state) in list(self._offsets.items()):
            if pk not in moved:
                del self._offsets[pk]
                continue
            restored = Offsets(pk, state.read, moved[pk])
            table = self._actions[index]["Update"]["TableName"]
            self._actions[index] = {"Update": restored.body(table)}
            self._offsets[pk] = (index, restored)

    def _end(self) -> None:
        self._ended = True

    def _request_token(self) -> str | None:
        """A ``ClientRequestToken`` for the commit, from the first marker's claim token: a
        commit botocore sends again (its answer lost) is then the same request to DynamoDB,
        which applies it once. None without a marker (botocore makes one up per call, and
        sends it again with the call).

        DynamoDB keeps a token 10 minutes and refuses it on another request
        (IdempotentParameterMismatchException), so it must be the commit's own: a digest (36
        characters) of all of the claim's token and of the marker's revision, drawn for this
        claim (a caller of ``claim_in`` may give one token to several), never a cut (the
        claim tokens of one process differ in their last digits)."""
        for marker in self._markers:
            if marker is not None:
                seed = f"{marker.record.token}\0{marker.rev}".encode()
                return hashlib.blake2b(seed, digest_size=18).hexdigest()
        return None


def _expressions(
    body: dict[str, Any],
    condition: str | None,
    names: Mapping[str, str] | None,
    values: Item | None,
) -> dict[str, Any]:
    if condition is not None:
        body["ConditionExpression"] = condition
    if names:
        body["ExpressionAttributeNames"] = dict(names)
    if values:
        body["ExpressionAttributeValues"] = dict(values)
    return body


def _checked(action: Action) -> dict[str, Any]:
    if not isinstance(action, Mapping) or len(action) != 1:
        raise ConfigurationError(
            f"a TransactItems action is one of {', '.join(_KINDS)} (a dict with one of "
            f"them as its only key), not {action!r}"
        )
    ((kind, body),) = action.items()
    if kind not in _KINDS or not isinstance(body, dict) or not body.get("TableName"):
        raise ConfigurationError(
            f"a TransactItems action is one of {', '.join(_KINDS)} with its TableName, not "
            f"{action!r}"
        )
    if kind != "Put" and not isinstance(body.get("Key"), Mapping):
        raise ConfigurationError(f"a {kind} action names its item's Key: {action!r}")
    if kind == "Put" and not isinstance(body.get("Item"), Mapping):
        raise ConfigurationError(f"a Put action carries its Item: {action!r}")
    return body
