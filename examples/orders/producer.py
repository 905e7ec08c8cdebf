"""The order producer: the order id is the message id, fixed before the first attempt (R2).

A publish that fails or times out is retried with the *same* id, so every copy downstream is
recognisably the same order. The script also sends what real traffic sends sooner or later: a
retry that reached the broker twice, and a bug that reuses an order id for another order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from oncely.brokers import Producer
from oncely.errors import BrokerUnavailable


async def publish_order(producer: Producer, order_id: str, order: Mapping[str, object]) -> None:
    """Publish one order, retrying with the same message id until the broker confirms it."""
    body = json.dumps(order).encode()
    for pause in (0.1, 0.5, 2.0, None):
        try:
            await producer.publish(body, message_id=order_id)
            return
        except BrokerUnavailable:
            if pause is None:
                raise
            await asyncio.sleep(pause)


def traffic(orders: int) -> list[tuple[str, dict[str, object]]]:
    """The copies the broker will carry, in order: each order once, every fourth one twice (a
    producer retry whose first attempt did reach the broker), one order needing a retry in the
    consumer (a flaky SKU), and one id reused for a different order."""
    sent: list[tuple[str, dict[str, object]]] = []
    for n in range(1, orders + 1):
        order_id = f"order-{n:04d}"
        sku = "flaky-widget" if n == 3 else f"sku-{n % 7}"
        order = {"customer_id": f"c-{n % 5}", "amount": f"{10 + n}.50", "lines": [sku, "gift-box"]}
        sent.append((order_id, order))
        if n % 4 == 0:
            sent.append((order_id, order))
    first_id, first = sent[0]
    sent.append((first_id, {**first, "amount": "999.00"}))  # same id, other content
    return sent
