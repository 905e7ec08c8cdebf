"""Fixtures of the integration tests: real databases, tables of their own, dropped afterwards.

``env`` serves the SQLAlchemy session tests (``test_sqlalchemy_*.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.integrations.sqlalchemy_helpers import Env, _model, _server_url

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
