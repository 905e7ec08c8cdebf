"""``oncely migrate``: create or upgrade the store's tables."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import click

import oncely
from oncely.cli._stores import opened, store_option

__all__ = ["migrate"]


@runtime_checkable
class _Versioned(Protocol):
    """Stores that can tell their schema version before migrating (SQL stores)."""

    def schema_version(self) -> int | None: ...


@runtime_checkable
class _Revised(Protocol):
    """Stores that can tell their schema revision too (oncely's SQL stores)."""

    def schema_revision(self) -> int: ...


@click.command()
@store_option
def migrate(store_url: str) -> None:
    """Create or upgrade the dedup tables, then print the schema version.

    Safe to run repeatedly and while consumers are running; an upgrade to a new schema
    version (SQLite and MariaDB/MySQL: 1 to 2) needs the workers of the older oncely stopped
    first, which refuse the upgraded tables. A schema written by a newer oncely is left alone
    and reported (exit 4): upgrade oncely instead. So is a table whose schema marker (the
    schema_version row of its _meta table) was deleted: the error says how to restore it.
    """
    with opened(store_url, create=True) as store:
        shown = oncely.redact(store_url)
        before = store.schema_version() if isinstance(store, _Versioned) else None
        revision = (
            store.schema_revision if isinstance(store, _Revised) and before is not None else None
        )
        was = revision() if revision is not None else None
        version = store.migrate()
        now = revision() if revision is not None else None
    if before is None:
        click.echo(f"schema version {version} ready in {shown}")
    elif before == version and was != now:
        # An upgrade within the version (PostgreSQL's purge index): it did work, maybe for
        # minutes on a large table; "already in place" would say it did nothing.
        click.echo(f"schema version {version} upgraded from revision {was} to {now} in {shown}")
    elif before == version:
        click.echo(f"schema version {version} already in place in {shown}")
    else:
        click.echo(f"schema upgraded from version {before} to {version} in {shown}")
