"""The command line against the real servers: every entry point takes every store URL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

import oncely
from oncely.cli import cli
from tests import services


def _with(url: str, **options: str) -> str:
    extra = "&".join(f"{k}={v}" for k, v in options.items())
    return url + ("&" if "?" in url else "?") + extra


@pytest.fixture(params=["postgresql", "mysql", "redis"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"oncely_cli_{uuid.uuid4().hex[:10]}"
    if request.param == "postgresql":
        services.require("PostgreSQL", services.POSTGRES_DSN, 5432)
        url = _with(services.POSTGRES_DSN, table=name)
    elif request.param == "mysql":
        services.require("MariaDB", services.MYSQL_URL, 3306)
        url = _with(services.MYSQL_URL, table=name)
    else:
        services.require("Redis", services.REDIS_URL, 6379)
        url = _with(services.REDIS_URL, prefix=name)
    yield url
    store = oncely.open(url)
    try:
        for record in store.scan(limit=1000):
            store.forget(record.consumer, record.key)
    finally:
        store.close()
    if request.param == "postgresql":
        import psycopg

        with psycopg.connect(services.POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {name}, {name}_meta")
    elif request.param == "mysql":
        import pymysql

        from oncely.stores.mysql.errors import parse_url

        settings = parse_url(services.MYSQL_URL).settings
        conn = pymysql.connect(database=settings.database, **settings.connect_kwargs())
        try:
            with conn.cursor() as cur:
                cur.execute(f"DROP TABLE IF EXISTS {name}, {name}_meta")
        finally:
            conn.close()


def test_migrate_stats_list_show_purge_on_every_server_store(store_url: str) -> None:
    runner = CliRunner()
    migrated = runner.invoke(cli, ["migrate", "--store", store_url])
    assert migrated.exit_code == 0, migrated.output
    store = oncely.open(store_url)
    inbox = oncely.Inbox(store, consumer="billing")
    assert inbox.handle("order-1", {"a": 1}, lambda p: "done").outcome is oncely.Outcome.PROCESSED
    store.close()
    stats = runner.invoke(cli, ["inbox", "stats", "--store", store_url, "--json", "--exact"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.stdout)["consumers"]["billing"]["completed"] == 1
    estimated = runner.invoke(cli, ["inbox", "stats", "--store", store_url, "--json"])
    assert estimated.exit_code == 0, estimated.output
    shown = json.loads(estimated.stdout)
    # An estimate, or an exact count where the store counts small tables outright (Redis).
    assert isinstance(shown["exact"], bool) and shown["total"] >= 1
    listed = runner.invoke(cli, ["inbox", "list", "--store", store_url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert "order-1" in listed.stdout
    shown = runner.invoke(
        cli, ["inbox", "show", "--store", store_url, "--consumer", "billing", "order-1"]
    )
    assert shown.exit_code == 0, shown.output
    assert "completed" in shown.stdout
    purged = runner.invoke(cli, ["inbox", "purge", "--store", store_url])
    assert purged.exit_code == 0, purged.output
