"""The project's handlers: plain functions that write through the ORM."""

from typing import Any

from oncely.integrations.django import get_inbox, handle_in_atomic
from orders.models import Charge


def charge(order: dict[str, Any]) -> dict[str, Any]:
    """Run by ``manage.py oncely consume --handler orders.handlers:charge``: the row and the
    message's record commit in one transaction.atomic()."""
    Charge.objects.create(order=order["order"], amount=order["amount"])
    return {"charged": order["amount"]}


def _refund_row(payload: dict[str, Any]) -> int:
    return Charge.objects.create(order=payload["order"], amount=-payload["amount"]).pk


def refund(order: str, amount: int) -> str:
    """Called from anywhere (a view, a signal, a script): once per refund key, the row and
    the key's record in one transaction."""
    done = handle_in_atomic(
        get_inbox("refunds"), f"refund:{order}", {"order": order, "amount": amount}, _refund_row
    )
    return f"{done.outcome.value}, row {done.value}"
