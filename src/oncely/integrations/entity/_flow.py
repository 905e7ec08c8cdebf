"""The entity-as-marker flow without I/O: plan, statements, decision (R6, R20-R22).

Everything here is pure: it builds SQLAlchemy statements and decides from rows, and the
step-by-step flow is a generator that *yields* each statement and is *sent* what the database
answered. :mod:`oncely.integrations.entity` drives it with a sync or an async connection, so the
logic exists once and the two shells only execute. What the flow comes to is an
:class:`~oncely.integrations.entity.EntityResult` (:mod:`oncely.integrations.entity._result`).

The flow (R20 steps 2-6, R21)::

    INSERT the row, so that a conflict on the key does not raise (or is caught, MySQL)
      inserted            -> created  (then the batch's other rows, R22)
      conflict on the key -> read the row by key
          found           -> compare fingerprint / immutable fields: duplicate | key_conflict
          not found       -> MySQL: the duplicate was on another unique key: re-raise it
                             ON CONFLICT: the row vanished in between (a concurrent delete): retry
"""

from __future__ import annotations

import datetime
import enum
import logging
import struct
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Final, TypeAlias

from sqlalchemy import (
    CHAR,
    NCHAR,
    Column,
    Index,
    Insert,
    Label,
    Table,
    TypeDecorator,
    UniqueConstraint,
    and_,
    insert,
    inspect,
    select,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError, NoInspectionAvailable
from sqlalchemy.sql import Executable

from oncely._core.fingerprint import Fingerprinter
from oncely.errors import ConfigurationError, InvalidKey, StoreUnavailable
from oncely.integrations.entity._result import EntityOutcome, EntityResult

LOGGER = logging.getLogger("oncely.entity")

__all__ = [
    "MISSING",
    "Answer",
    "Entity",
    "Flow",
    "Plan",
    "Reply",
    "Rows",
    "RowsOrFactory",
    "Step",
    "flow",
    "is_duplicate_key",
    "make_plan",
    "shape_of",
]

Entity: TypeAlias = Table | type[object]
"""A Core :class:`~sqlalchemy.Table` or an ORM-mapped class (its names are attribute names)."""

Values: TypeAlias = Mapping[str, object]
Rows: TypeAlias = Sequence[tuple[Entity, Values]]
RowsOrFactory: TypeAlias = Rows | Callable[[Mapping[str, object]], Rows]


class Missing(enum.Enum):
    """Marks an argument that was not given (``None`` is a valid payload)."""

    MISSING = enum.auto()


MISSING: Final = Missing.MISSING

# MySQL/MariaDB error numbers that mean "duplicate key": ER_DUP_KEY, ER_DUP_ENTRY,
# ER_DUP_ENTRY_WITH_KEY_NAME.
_MYSQL_DUPLICATE: Final = frozenset({1022, 1062, 1586})
_ON_CONFLICT_DIALECTS: Final = frozenset({"postgresql", "sqlite"})
_MYSQL_DIALECTS: Final = frozenset({"mysql", "mariadb"})
_ATTEMPTS: Final = 3
# Dialects whose CHAR(n) pads to n (PostgreSQL) or strips trailing spaces (MySQL/MariaDB), and
# compares text without them: SQLite keeps the text as written.
_PADDING_DIALECTS: Final = frozenset({"postgresql"}) | _MYSQL_DIALECTS


@dataclass(frozen=True, slots=True)
class Shape:
    """A table, the caller's names for its columns, and the values the ORM would set that
    the caller does not give (a polymorphic class's discriminator)."""

    table: Table
    columns: Mapping[str, Column[object]]
    fixed: Mapping[Column[object], object] = field(default_factory=dict)


def shape_of(entity: Entity) -> Shape:
    """The table behind a Core table or an ORM class; raises ConfigurationError otherwise."""
    if isinstance(entity, Table):
        return Shape(entity, {c.key: c for c in entity.columns})
    try:
        mapper = inspect(entity)
    except NoInspectionAvailable:
        raise ConfigurationError(
            f"{entity!r} is neither a sqlalchemy Table nor an ORM-mapped class"
        ) from None
    table = mapper.local_table
    parent = mapper.inherits
    if not isinstance(table, Table) or (
        parent is not None and not mapper.concrete and parent.local_table is not table
    ):
        raise ConfigurationError(
            f"{entity!r} is not mapped to a single table (joined-table inheritance spreads "
            "its rows over several); pass its tables, the base one as the entity and the "
            "others as create_batch_once rows"
        )
    columns: dict[str, Column[object]] = {
        name: col
        for name, col in mapper.columns.items()
        if isinstance(col, Column) and col.table is table
    }
    # A polymorphic class's rows carry its identity in the discriminator column, which the
    # ORM sets on a flush; a row inserted without it cannot be loaded (or loads as another
    # class).
    on, identity = mapper.polymorphic_on, mapper.polymorphic_identity
    fixed: dict[Column[object], object] = {}
    if isinstance(on, Column) and on.table is table and identity is not None:
        fixed[on] = identity
    return Shape(table, columns, fixed)


def _column_dict(shape: Shape, values: Values, what: str) -> dict[Column[object], object]:
    unknown = [name for name in values if name not in shape.columns]
    if unknown:
        raise ConfigurationError(
            f"{what}: table {shape.table.name} has no column {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(shape.columns)}"
        )
    given = {shape.columns[name]: value for name, value in values.items()}
    return {**shape.fixed, **given} if shape.fixed else given


_RETYPED: Final = (datetime.datetime, datetime.date, datetime.time, uuid.UUID)
"""Column types whose values come back as that type whatever was written (a string, a date
for a datetime): a compared value must already be one."""
_TEMPORAL: Final = (datetime.datetime, datetime.time)


def _comparable(shape: Shape, name: str, given: object, dialect: Dialect) -> None:
    """Refuse a compared value that would come back from the database as another value, so
    that every copy of the message would be a key_conflict: a value of another type than the
    column's (``"10.00"`` for a ``Numeric`` column, ``17`` for a ``String`` one), a number
    with more decimal places than the column keeps (``Decimal("10.123")`` for
    ``Numeric(10, 2)``), or a datetime or time whose time zone or fraction of a second the
    column does not keep (see :func:`_temporal`)."""
    if given is None:
        return
    column_type = shape.columns[name].type
    try:
        wanted = column_type.python_type
    except NotImplementedError:
        return
    numbers = (int, float, Decimal)
    number = isinstance(given, numbers) and not isinstance(given, bool)
    if issubclass(wanted, numbers) and not issubclass(wanted, bool):
        if not number:
            raise ConfigurationError(
                f"values: {name} is a {type(given).__name__} ({given!r}) for a {column_type} "
                "column, which gives back a number: every copy would differ from the stored "
                f"row (a key_conflict). Pass a {wanted.__name__} (Decimal(...) for a string "
                "amount)"
            )
        if isinstance(given, float) and _single(column_type, dialect) and _lossy32(given):
            raise ConfigurationError(
                f"values: {name}={given!r} is a float its column {column_type} keeps in single "
                f"precision on {dialect.name} (it gives back {_as32(given)!r}): every copy would "
                "differ from the stored row (a key_conflict, or an IntegrityError for a key). "
                "Declare the column with double precision (Double, or Numeric for amounts)"
            )
        scale = getattr(column_type, "scale", None)
        if isinstance(scale, int) and not isinstance(given, int):
            exponent = Decimal(str(given)).as_tuple().exponent
            if isinstance(exponent, int) and -exponent > scale:
                raise ConfigurationError(
                    f"values: {name}={given!r} has more decimal places than its column "
                    f"{column_type} keeps: the database would round it, and every copy would "
                    f"differ from the stored row (a key_conflict). Round it to {scale} places "
                    "first"
                )
        return
    if wanted is str and not isinstance(given, str) and not isinstance(column_type, TypeDecorator):
        raise ConfigurationError(
            f"values: {name} is a {type(given).__name__} ({given!r}) for a {column_type} "
            "column, which gives back a str: every copy would differ from the stored row (a "
            "key_conflict; on PostgreSQL the read by key fails). Pass a str"
        )
    if wanted in _RETYPED and not isinstance(given, wanted):
        raise ConfigurationError(
            f"values: {name} is a {type(given).__name__} ({given!r}) for a {column_type} "
            f"column, which gives back a {wanted.__name__}: every copy would differ from the "
            f"stored row (a key_conflict). Pass a {wanted.__name__}"
        )
    if isinstance(given, datetime.datetime | datetime.time) and wanted in _TEMPORAL:
        _temporal(name, given, column_type.dialect_impl(dialect), dialect.name)


def _single(column_type: object, dialect: Dialect) -> bool:
    """Whether the column keeps a float in 4 bytes on ``dialect``: MySQL/MariaDB's ``FLOAT``
    (SQLAlchemy's ``Float()``), PostgreSQL's ``REAL``, and ``FLOAT(p)`` with p up to 24 on
    either; SQLite keeps 8."""
    if dialect.name == "sqlite":
        return False
    try:
        ddl = dialect.type_compiler_instance.process(column_type).upper()  # type: ignore[arg-type]
    except Exception:
        return False
    if ddl == "REAL":
        return dialect.name == "postgresql"  # MySQL's REAL is a DOUBLE
    if not ddl.startswith("FLOAT"):
        return False
    digits = ddl[5:].strip(" ()")
    if not digits:
        return dialect.name in _MYSQL_DIALECTS  # PostgreSQL's FLOAT is double precision
    return digits.isdigit() and int(digits) <= 24


def _as32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]  # type: ignore[no-any-return]


def _lossy32(value: float) -> bool:
    try:
        return _as32(value) != value
    except OverflowError:
        return True


def _temporal(
    name: str, given: datetime.datetime | datetime.time, impl: object, dialect: str
) -> None:
    """Refuse a datetime or time the column gives back as another value. Only PostgreSQL
    keeps a time zone, and only in a ``timezone=True`` column, which answers an aware value
    even for a naive one; SQLite and MySQL/MariaDB drop it. MySQL/MariaDB keep the fraction
    of a second to the column's ``fsp`` digits (none by default), PostgreSQL to its
    ``precision``. A key column matters most: its value is also what the stored row is read
    back by, so a changed key is not found and the conflict raised as an IntegrityError."""
    zoned = dialect == "postgresql" and bool(getattr(impl, "timezone", False))
    aware = given.utcoffset() is not None
    if aware != zoned:
        raise ConfigurationError(
            f"values: {name}={given!r} is {'an aware' if aware else 'a naive'} "
            f"{type(given).__name__} for a column that gives back a "
            f"{'naive' if aware else 'aware'} one on {dialect}: every copy would differ from "
            "the stored row (a key_conflict, or an IntegrityError for a key). Pass "
            f"{'a naive value (in UTC, say)' if aware else 'an aware value'}"
        )
    digits = getattr(impl, "fsp" if dialect in _MYSQL_DIALECTS else "precision", None)
    if dialect in _MYSQL_DIALECTS and digits is None:
        digits = 0
    if isinstance(digits, int) and 0 <= digits < 6 and given.microsecond % 10 ** (6 - digits):
        raise ConfigurationError(
            f"values: {name}={given!r} has more fractional seconds than its column keeps "
            f"({digits} digits on {dialect}): the database would cut them, and every copy "
            "would differ from the stored row (a key_conflict, or an IntegrityError for a "
            f"key). Cut them first, or declare the column with more fractional digits"
        )


def _whole_columns(index: Index, dialect: str) -> bool:
    """An index of plain columns on every row: no expression (``lower(email)``: unique on
    its value, not the column's, though ``index.columns`` lists the column) and no ``WHERE``
    on this dialect (a partial index; MySQL/MariaDB have none). ON CONFLICT cannot name
    either by its columns alone (the database refuses the statement), nor would a read by
    key see the rows the index holds."""
    partial = index.dialect_kwargs.get(f"{dialect}_where") is not None
    return not partial and all(isinstance(e, Column) for e in index.expressions)


def _unique_sets(table: Table, dialect: str) -> list[frozenset[str]]:
    sets = [frozenset(c.name for c in table.primary_key.columns)]
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            sets.append(frozenset(c.name for c in constraint.columns))
    for index in table.indexes:
        if isinstance(index, Index) and index.unique and _whole_columns(index, dialect):
            sets.append(frozenset(c.name for c in index.columns))
    sets.extend(frozenset({c.name}) for c in table.columns if c.unique)
    return sets


@dataclass(frozen=True, slots=True)
class Plan:
    """One create, validated: what to insert, how, and what to compare on a conflict."""

    shape: Shape
    dialect: str
    returning: bool
    key: Mapping[str, object]
    row: Mapping[str, object]
    compared: tuple[str, ...]
    rows: RowsOrFactory = ()
    batch: bool = False
    padded: frozenset[str] = frozenset()
    """Compared CHAR(n) columns, whose trailing spaces the database does not tell apart."""

    @property
    def on_conflict(self) -> bool:
        return self.dialect in _ON_CONFLICT_DIALECTS

    def insert(self) -> Executable:
        table = self.shape.table
        values = _column_dict(self.shape, self.row, "values")
        keys = [self.shape.columns[name] for name in self.key]
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert  # noqa: PLC0415

            statement: Insert = (
                pg_insert(table).values(values).on_conflict_do_nothing(index_elements=keys)
            )
        elif self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert  # noqa: PLC0415

            statement = (
                sqlite_insert(table).values(values).on_conflict_do_nothing(index_elements=keys)
            )
        else:
            statement = insert(table).values(values)
        if self.returning:
            return statement.returning(*self._labelled())
        return statement

    def read(self) -> Executable:
        where = and_(*(self.shape.columns[name] == value for name, value in self.key.items()))
        statement = select(*self._labelled()).where(where)
        if self.dialect in _MYSQL_DIALECTS:
            # InnoDB's REPEATABLE READ would answer a plain SELECT from the transaction's
            # snapshot, which may predate the winner's commit; a locking read sees the latest
            # committed row. PostgreSQL needs none: ON CONFLICT only returns once the
            # conflicting row is committed and visible (or raises a serialization failure).
            statement = statement.with_for_update(read=True)
        return statement

    def _labelled(self) -> list[Label[object]]:
        return [col.label(name) for name, col in self.shape.columns.items()]

    def batch_steps(self, created: Mapping[str, object]) -> list[Step]:
        """The inserts of the batch's other rows, in order; consecutive rows of one table with
        the same columns go as one executemany."""
        rows = self.rows(created) if callable(self.rows) else self.rows
        groups: list[tuple[Table, list[dict[str, object]]]] = []
        for entity, values in rows:
            shape = shape_of(entity)
            params = {col.key: value for col, value in _column_dict(shape, values, "rows").items()}
            if groups and groups[-1][0] is shape.table and groups[-1][1][0].keys() == params.keys():
                groups[-1][1].append(params)
            else:
                groups.append((shape.table, [params]))
        return [Step(insert(table), params=params) for table, params in groups]

    def created(self, row: Mapping[str, object]) -> EntityResult:
        return EntityResult(EntityOutcome.CREATED, dict(self.key), row)

    def decide(self, stored: Mapping[str, object]) -> EntityResult:
        """Duplicate when every compared field equals the stored one, else key_conflict."""
        differing = tuple(
            name
            for name in self.compared
            if not same_value(self.row.get(name), stored.get(name), name in self.padded)
        )
        if not differing:
            return EntityResult(EntityOutcome.DUPLICATE, dict(self.key), stored)
        shown = ", ".join(f"{name}={value!r}"[:120] for name, value in self.key.items())
        reason = (
            f"{self.shape.table.name} row ({shown}) exists with a different "
            f"{', '.join(differing)}: the key was reused for other content, or the content "
            "changed after the first processing (R20 step 6); dead-letter and alert"
        )
        # As the inbox logs its key_conflict: a person must look, whatever the caller does
        # with the result (a caller that acks whatever was not created would drop it).
        LOGGER.error("oncely key_conflict entity: %s", reason)
        return EntityResult(EntityOutcome.KEY_CONFLICT, dict(self.key), stored, differing, reason)


def same_value(given: object, stored: object, padded: bool = False) -> bool:
    """Python equality, except that numbers compare by decimal value (a ``Numeric(10, 2)``
    column answers ``Decimal("5.00")`` for ``5`` and ``Decimal("0.10")`` for ``0.1``), and
    ``padded`` text (a CHAR(n) column on PostgreSQL or MySQL/MariaDB, which answer ``"o-1"``
    padded to n, or stripped, and compare text so) without its trailing spaces.

    Anything else that the database changes on the way (a time zone dropped) compares
    unequal: a false key_conflict is loud, a false duplicate would drop a message.
    """
    if given == stored:
        return True
    if padded and isinstance(given, str) and isinstance(stored, str):
        return given.rstrip(" ") == stored.rstrip(" ")
    numbers = (int, float, Decimal)
    if (
        isinstance(given, numbers)
        and isinstance(stored, numbers)
        and not isinstance(given, bool)
        and not isinstance(stored, bool)
    ):
        try:
            return Decimal(str(given)) == Decimal(str(stored))
        except InvalidOperation:
            return False
    return False


def make_plan(
    entity: Entity,
    dialect: Dialect,
    key: Values,
    values: Values | None,
    compare: Sequence[str],
    fingerprint_column: str | None,
    payload: object,
    fingerprinter: Fingerprinter,
    rows: RowsOrFactory | None = None,
) -> Plan:
    """Validate one create and compute its fingerprint; raises ConfigurationError or InvalidKey.

    The parameters are those of :func:`~oncely.integrations.entity.create_once` and its kin, in
    their order, so that the four of them pass their arguments on alike; ``rows`` (even empty)
    makes it a batch (:func:`~oncely.integrations.entity.create_batch_once`)."""
    if dialect.name not in _ON_CONFLICT_DIALECTS | _MYSQL_DIALECTS:
        raise ConfigurationError(
            f"the entity marker supports sqlite, postgresql, mysql and mariadb, not {dialect.name}"
        )
    shape = shape_of(entity)
    if isinstance(compare, str):
        raise ConfigurationError(f"compare must be a sequence of names, not the string {compare!r}")
    if not key:
        raise ConfigurationError("key must name at least one column")
    missing = [name for name, value in key.items() if value is None]
    if missing:
        raise InvalidKey(f"key column {', '.join(missing)} is None; a dedup key needs a value")
    _column_dict(shape, key, "key")
    key_names = frozenset(shape.columns[name].name for name in key)
    if key_names not in _unique_sets(shape.table, dialect.name):
        raise ConfigurationError(
            f"key ({', '.join(key)}) is not the primary key nor a unique constraint or index of "
            f"table {shape.table.name}; the entity's unique key IS the dedup key (R6, R20), so "
            "declare it on the Table or model (a partial or expression index cannot be it)"
        )
    row: dict[str, object] = dict(values or {})
    clash = [name for name in key if name in row and row[name] != key[name]]
    if clash:
        raise ConfigurationError(f"values give {', '.join(clash)} other than the key does")
    row.update(key)
    if not compare and fingerprint_column is None:
        raise ConfigurationError(
            "say how to tell a duplicate from a key conflict (R20 step 5): compare=(immutable "
            "business fields) and/or fingerprint_column=(a column that stores the fingerprint)"
        )
    not_written = [name for name in compare if name not in row]
    if not_written:
        raise ConfigurationError(
            f"compare names {', '.join(not_written)}, which values do not give; only written "
            "fields can be compared"
        )
    compared = list(key) + [name for name in compare if name not in key]
    for name, column in shape.columns.items():
        if column in shape.fixed:  # a copy created as another class is other content
            row.setdefault(name, shape.fixed[column])
            if name not in compared:
                compared.append(name)
    if fingerprint_column is not None:
        if payload is MISSING:
            raise ConfigurationError("fingerprint_column needs the payload to fingerprint")
        if fingerprint_column in row:
            raise ConfigurationError(
                f"values give {fingerprint_column}, which oncely computes from the payload"
            )
        print_ = fingerprinter(payload)
        row[fingerprint_column] = print_
        if print_ is not None:  # Fingerprint.none(): no content check on the fingerprint
            compared.append(fingerprint_column)
    elif payload is not MISSING:
        raise ConfigurationError("a payload is only used with fingerprint_column")
    _column_dict(shape, row, "values")
    for name in compared:
        if name != fingerprint_column:
            _comparable(shape, name, row[name], dialect)
    return Plan(
        shape=shape,
        dialect=dialect.name,
        returning=dialect.insert_returning,
        key=dict(key),
        row=row,
        compared=tuple(compared),
        padded=frozenset(
            name
            for name in compared
            if dialect.name in _PADDING_DIALECTS
            and isinstance(shape.columns[name].type, CHAR | NCHAR)
        ),
        rows=() if rows is None else rows,
        batch=rows is not None,
    )


@dataclass(frozen=True, slots=True)
class Step:
    """One statement for a shell to execute; ``duplicate_ok`` asks it to send back a
    duplicate-key IntegrityError instead of raising it."""

    statement: Executable
    params: list[dict[str, object]] | None = None
    fetch: bool = False
    duplicate_ok: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """What the database answered to a Step: rows (when fetched) and the row count."""

    rows: list[dict[str, object]]
    rowcount: int = -1


Reply: TypeAlias = Answer | IntegrityError
Flow: TypeAlias = Generator[Step, Reply, EntityResult]


def is_duplicate_key(error: IntegrityError) -> bool:
    """True for a MySQL/MariaDB duplicate-key error (on any unique key: the flow re-reads)."""
    args: tuple[object, ...] = getattr(error.orig, "args", ())
    return bool(args) and args[0] in _MYSQL_DUPLICATE


def flow(plan: Plan) -> Flow:
    """The create as a generator of Steps; returns the result or raises what the database
    raised (anything but a duplicate on the key)."""
    for _ in range(_ATTEMPTS):
        reply = yield Step(plan.insert(), fetch=plan.returning, duplicate_ok=not plan.on_conflict)
        duplicate = reply if isinstance(reply, IntegrityError) else None
        if isinstance(reply, Answer):
            if plan.returning:
                inserted = bool(reply.rows)
            else:
                inserted = reply.rowcount == 1 if plan.on_conflict else True
            if inserted:
                row = reply.rows[0] if plan.returning else None
                if row is None:
                    answer = yield Step(plan.read(), fetch=True)
                    row = _only(answer).rows[0]
                if plan.batch:
                    for step in plan.batch_steps(row):
                        _only((yield step))
                return plan.created(row)
        stored = _only((yield Step(plan.read(), fetch=True)))
        if stored.rows:
            return plan.decide(stored.rows[0])
        if duplicate is not None:
            # The duplicate was on another unique key: an error of the caller's data.
            raise duplicate
    raise StoreUnavailable(
        f"{plan.shape.table.name}: the row conflicted on its key but was gone when read, "
        f"{_ATTEMPTS} times (concurrent deletes?); retry the message later"
    )


def _only(reply: Reply) -> Answer:
    if isinstance(reply, IntegrityError):  # pragma: no cover - shells only send it back
        raise reply  # for a Step with duplicate_ok
    return reply
