"""The handler ``manage.py oncely consume`` runs in the tests: a charge row per call, in the
transaction oncely's marker commits in; each start counted in Redis (outside it)."""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from shop.models import Charge

import oncely

NS = os.environ.get("ONCELY_TEST_DJANGO_NS", "oncely_dj")
REDIS = redis.Redis.from_url(os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"))


def charge(order: dict[str, Any]) -> dict[str, Any]:
    name = str(order["order"])
    started = REDIS.incr(f"{NS}:started:{name}")
    Charge.objects.create(order=name, amount=int(order.get("amount", 1)))
    time.sleep(float(order.get("sleep", 0)))
    if started <= int(order.get("fail_times", 0)):
        raise RuntimeError(f"the ledger is down (start {started})")
    if order.get("reject"):
        raise oncely.Reject("not an order of ours")
    return {"charged": name, "start": started}


async def not_sync(order: dict[str, Any]) -> None:
    """Refused by ``manage.py oncely consume``: Django's ORM is synchronous."""


def charge_in(tx: object, order: dict[str, Any]) -> None:
    """Refused by ``manage.py oncely consume``: written for ``oncely consume --mode
    transactional``, it takes a ``tx`` the Django worker never passes (its ORM writes join
    the record's ``transaction.atomic()`` by themselves)."""
    Charge.objects.create(order=str(order["order"]))
