"""Fixtures of the integration tests: real databases, tables of their own, dropped afterwards.

``env`` serves the SQLAlchemy session tests (``test_sqlalchemy_*.py``); ``db`` and ``adb`` serve
the entity-as-marker tests (``test_entity_*.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.integrations.entity_helpers import Db, _engine, _tables, _url
from tests.integrations.sqlalchemy_helpers import Env, _model, _server_url
from tests.services import REQUIRED

BACKENDS = ["sqlite", "postgresql", "mariadb"]


@pytest.fixture(params=BACKENDS)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    backend = str(request.param)
    unique = uuid.uuid4().hex[:10]
    base, booking = _model(f"osa_{unique}_bookings")
    path = tmp_path / "app.db"
    url = f"sqlite:///{path}" if backend == "sqlite" else None
    if url is None:
        url = _server_url(backend, "psycopg" if backend == "postgresql" else "pymysql")
    engine = sa.create_engine(url)
    base.metadata.create_all(engine)
    e = Env(backend, path, f"osa_{unique}_inbox", booking, base, engine)
    try:
        yield e
    finally:
        for close in reversed(e.closers):
            close()
        base.metadata.drop_all(engine)
        quote = engine.dialect.identifier_preparer.quote
        with engine.begin() as conn:
            for name in (e.inbox_table, f"{e.inbox_table}_meta"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(name)}")
        engine.dispose()


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    url = _url(str(request.param), tmp_path)
    engine = _engine(url)
    metadata = sa.MetaData()
    customers, orders, lines, outbox = _tables(metadata)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(customers), [{"customer_id": "c-1"}, {"customer_id": "c-2"}])
    try:
        yield Db(str(request.param), engine, url, customers, orders, lines, outbox)
    finally:
        metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture(params=BACKENDS)
async def adb(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Db, object]]:
    try:
        import greenlet  # noqa: F401
    except ImportError:
        reason = "SQLAlchemy's asyncio needs greenlet: install SQLAlchemy[asyncio]"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    from sqlalchemy.ext.asyncio import create_async_engine

    backend = str(request.param)
    url = _url(backend, tmp_path)
    engine = _engine(url)
    metadata = sa.MetaData()
    customers, orders, lines, outbox = _tables(metadata)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(customers), [{"customer_id": "c-1"}, {"customer_id": "c-2"}])
    aengine = create_async_engine(_url(backend, tmp_path, asynchronous=True))
    try:
        yield Db(backend, engine, url, customers, orders, lines, outbox), aengine
    finally:
        await aengine.dispose()
        metadata.drop_all(engine)
        engine.dispose()
