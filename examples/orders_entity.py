"""The order is its own dedup marker (R20): python examples/orders_entity.py [DIR]

An order consumer on SQLite with no inbox table: the order id (the broker's MessageId) is the
orders table's primary key, so every copy of an order maps to the same row. Each order is
created with its lines and an outbox row in one all-or-nothing batch (R22); a copy is a
duplicate and is acknowledged; the same id with other content is a key conflict, which is
dead-lettered instead of dropped.
"""

from __future__ import annotations

import sys
import tempfile
from decimal import Decimal
from pathlib import Path

import sqlalchemy as sa

from oncely.integrations.entity import EntityResult, create_batch_once

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("order_id", sa.String(64), primary_key=True),  # the dedup key
    sa.Column("customer_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.Numeric(10, 2), nullable=False),
)
order_lines = sa.Table(
    "order_lines",
    metadata,
    sa.Column("order_id", sa.ForeignKey("orders.order_id"), primary_key=True),
    sa.Column("line_no", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("sku", sa.String(32), nullable=False),
)
outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("event", sa.String(200), nullable=False),
)


def consume(engine: sa.Engine, message_id: str, order: dict[str, object]) -> EntityResult:
    """Handle one delivery; the caller acks or dead-letters by ``result.action``."""
    lines = order["lines"]
    assert isinstance(lines, list)
    with engine.begin() as conn:
        return create_batch_once(
            conn,
            orders,
            key={"order_id": message_id},  # R20 step 1: MessageId = order id
            values={"customer_id": order["customer_id"], "amount": order["amount"]},
            compare=("customer_id", "amount"),  # the immutable business fields (step 5)
            rows=[
                *(
                    (order_lines, {"order_id": message_id, "line_no": n, "sku": sku})
                    for n, sku in enumerate(lines, 1)
                ),
                (outbox, {"event": f"order {message_id} accepted"}),
            ],
        )


def main(workdir: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{workdir / 'orders.db'}")
    metadata.create_all(engine)
    order = {"customer_id": "c-7", "amount": Decimal("25.00"), "lines": ["book", "pen"]}
    for delivery in (1, 2):  # an at-least-once broker redelivers
        result = consume(engine, "o-1", order)
        print(f"delivery {delivery} of o-1: {result.outcome} -> {result.action}")
    result = consume(engine, "o-1", {**order, "amount": Decimal("30.00")})
    print(
        f"o-1 reused with another amount: {result.outcome} -> {result.action} "
        f"(differing: {', '.join(result.differing)})"
    )
    with engine.connect() as conn:
        counts = [
            conn.scalar(sa.select(sa.func.count()).select_from(table))
            for table in (orders, order_lines, outbox)
        ]
    print("orders: {}, lines: {}, outbox: {}".format(*counts))
    engine.dispose()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
