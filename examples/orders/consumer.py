"""The order consumer: the order row is its own dedup marker (R6, R20-R22).

Each message's id is the order id (R20 step 1). The consumer creates the order, its lines and an
outbox event in one transaction (R22); the creation is the check (R21). A copy of an order is a
``duplicate`` and is acknowledged; the same id with other content is a ``key_conflict`` and is
dead-lettered with the reason (R20 step 6); a transient error (the stock service timing out)
rolls everything back and the message is given back for a later try (``failed``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from oncely import Envelope, Handled, Outcome
from oncely.integrations.entity import create_batch_once_async

log = logging.getLogger("orders")

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("order_id", sa.String(64), primary_key=True),  # the dedup key: the message id
    sa.Column("customer_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.Numeric(10, 2), nullable=False),
)
order_lines = sa.Table(
    "order_lines",
    metadata,
    sa.Column("order_id", sa.ForeignKey("orders.order_id"), primary_key=True),
    sa.Column("line_no", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("sku", sa.String(64), nullable=False),
)
outbox = sa.Table(
    "order_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("event", sa.String(64), nullable=False),
)


class StockServiceTimeout(Exception):
    """A transient failure: the order is retried later, nothing of it is kept meanwhile."""


class StockService:
    """Reserves stock. The ``flaky-*`` SKUs time out on their first call, as a busy service
    does, so the example shows a retry."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def reserve(self, order_id: str, sku: str) -> None:
        self.calls[order_id] = self.calls.get(order_id, 0) + 1
        if sku.startswith("flaky-") and self.calls[order_id] == 1:
            raise StockServiceTimeout(f"stock service timed out reserving {sku}")


class OrderConsumer:
    """An :class:`oncely.brokers.Processor`: creates each order once, in PostgreSQL."""

    consumer = "orders"

    def __init__(self, engine: AsyncEngine, stock: StockService) -> None:
        self.engine = engine
        self.stock = stock

    async def process(self, envelope: Envelope) -> Handled[Any]:
        order_id = envelope.message_id
        body = envelope.body
        if not order_id or not isinstance(body, Mapping):
            return self.refuse("an order needs a message id and a JSON object body")
        lines = [str(sku) for sku in body.get("lines", [])]
        try:
            async with self.engine.begin() as conn:
                result = await create_batch_once_async(
                    conn,
                    orders,
                    key={"order_id": order_id},
                    values={"customer_id": body["customer_id"], "amount": Decimal(body["amount"])},
                    compare=("customer_id", "amount"),  # the immutable fields (R20 step 5)
                    rows=[
                        *(
                            (order_lines, {"order_id": order_id, "line_no": n, "sku": sku})
                            for n, sku in enumerate(lines, 1)
                        ),
                        (outbox, {"order_id": order_id, "event": "order_accepted"}),
                    ],
                )
                if result.outcome == "created":
                    for sku in lines:  # inside the transaction: a failure undoes the order
                        await self.stock.reserve(order_id, sku)
        except StockServiceTimeout as exc:
            return Handled(Outcome.FAILED, self.consumer, order_id, reason=str(exc), error=exc)
        except (KeyError, ArithmeticError, ValueError) as exc:
            return self.refuse(f"malformed order: {exc!r}")
        return result.handled(self.consumer)

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        return Handled(Outcome.REJECTED, self.consumer, key, reason=reason)
