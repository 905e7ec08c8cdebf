"""The FastAPI app ``tests/web/test_fastapi.py`` serves with uvicorn: routes made idempotent
one by one with the ``Idempotency`` dependency (the store from ``ONCELY_TEST_HTTP_STORE``).
``POST /orders`` declares it, ``POST /notes`` does not, ``POST /late`` declares it but is
added after ``install``; ``POST /api/shop/v1/refunds`` declares it in a router included in a
router, ``POST /billing/invoices`` gets it from its router's dependencies; ``GET /effects``
counts the runs."""

from __future__ import annotations

import os
from collections import Counter

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel

import oncely
from oncely.integrations.fastapi import Idempotency

EFFECTS: Counter[str] = Counter()
inbox = oncely.AsyncInbox(
    oncely.open_async(os.environ["ONCELY_TEST_HTTP_STORE"]), consumer="orders-api"
)
idempotency = Idempotency(
    inbox, principal=lambda s: dict(s["headers"]).get(b"x-client", b"-").decode()
)
app = FastAPI()


class Order(BaseModel):
    id: str
    amount: int = 1


@app.post("/orders", status_code=201)
async def orders(order: Order, key: str | None = Depends(idempotency)) -> dict[str, object]:
    EFFECTS[order.id] += 1
    return {"order": order.id, "key": key, "run": EFFECTS[order.id]}


@app.post("/notes", status_code=201)
async def notes(order: Order) -> dict[str, object]:
    EFFECTS[order.id] += 1
    return {"note": order.id, "run": EFFECTS[order.id]}


@app.get("/effects")
async def effects() -> dict[str, int]:
    return dict(EFFECTS)


shop = APIRouter(prefix="/shop")  # routers included in routers, as large apps are laid out
refunds = APIRouter()


@refunds.post("/refunds", status_code=201)
async def refund(order: Order, key: str | None = Depends(idempotency)) -> dict[str, object]:
    EFFECTS[order.id] += 1
    return {"refund": order.id, "key": key, "run": EFFECTS[order.id]}


shop.include_router(refunds, prefix="/v1")
app.include_router(shop, prefix="/api")
billing = APIRouter()  # idempotent as a whole: the dependency is the router's


@billing.post("/invoices", status_code=201)
async def invoice(order: Order) -> dict[str, object]:
    EFFECTS[order.id] += 1
    return {"invoice": order.id, "run": EFFECTS[order.id]}


app.include_router(billing, prefix="/billing", dependencies=[Depends(idempotency)])
INSTALLED = idempotency.install(app)


@app.post("/late", status_code=201)
async def late(order: Order, key: str | None = Depends(idempotency)) -> dict[str, object]:
    EFFECTS[order.id] += 1
    return {"late": order.id}


@app.get("/installed")
async def installed() -> list[str]:
    return INSTALLED
