"""``--store URL``: where it comes from and how a command opens (and always closes) it.

The URL comes from ``--store``, else the ``ONCELY_STORE`` environment variable, else
``sqlite:///oncely.db``. Inspection commands never create anything: they open SQLite with
``migrate=false`` and refuse a file that does not exist, so a mistyped path says so instead of
leaving an empty database behind. Only ``oncely migrate`` creates or upgrades tables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, TypeVar
from urllib.parse import parse_qs, urlsplit

import click

import oncely
from oncely import Store
from oncely.cli._errors import SCHEMA, STORE_UNAVAILABLE, CliError, remember_secrets
from oncely.errors import ConfigurationError, OncelyError
from oncely.stores.sqlite.errors import missing_directory

__all__ = ["DEFAULT_STORE", "ENV_STORE", "opened", "refuse_missing_directory", "store_option"]

ENV_STORE: Final = "ONCELY_STORE"
DEFAULT_STORE: Final = "sqlite:///oncely.db"

F = TypeVar("F", bound=Callable[..., object])


def store_option(fn: F) -> F:
    """The ``--store`` option, shared by every command that opens a store."""
    return click.option(
        "--store",
        "store_url",
        metavar="URL",
        envvar=ENV_STORE,
        show_envvar=True,
        default=DEFAULT_STORE,
        show_default=True,
        help=(
            "The dedup store: sqlite:///relative.db, sqlite:////absolute.db, "
            "postgresql://user@host/db, mysql://user@host/db (or mariadb://), "
            "redis://host:6379/0, dynamodb://host:port/table (an endpoint) or "
            "dynamodb:///table?region=eu-west-1 (AWS), or memory://."
        ),
    )(fn)


def _sqlite_path(url: str) -> str | None:
    """The file a ``sqlite:`` URL names, or None when it names no plain file."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "sqlite":
        return None
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return path


def _without_auto_migrate(url: str) -> str:
    # Stores create their tables on first use unless told otherwise; an inspection command
    # must not, or `oncely inbox stats` on a typo would leave new tables behind.
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("memory",) or "migrate" in parse_qs(urlsplit(url).query):
        return url
    return url + _added(url)


def _added(url: str) -> str:
    """What :func:`_without_auto_migrate` adds at the end of ``url``."""
    return ("&" if "?" in url else "?") + "migrate=false"


def _named_as_typed(store: Store, target: str, url: str) -> None:
    """Make ``store``, opened at ``target`` (``url`` with ``migrate=false`` added), name
    ``url`` as the user typed it wherever it names its URL: its ``url``, its errors, the
    lines logged about it (a purge service's warning that a run failed, each run's line).
    oncely's PostgreSQL and Redis stores keep the URL they were given (password hidden)
    and name it so; the MariaDB and SQLite stores name one made without their options, and a
    store of another package keeps its own (its errors are renamed in :func:`opened`)."""
    shown = getattr(store, "_url", None)
    added = _added(url)
    if target != url and isinstance(shown, str) and shown.endswith(added):
        store._url = shown[: -len(added)]  # type: ignore[attr-defined]


def _defaulted() -> bool:
    """Whether the running command's store URL is the default: neither --store nor
    $ONCELY_STORE gave one."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or "store_url" not in ctx.params:
        return False
    return ctx.get_parameter_source("store_url") is click.core.ParameterSource.DEFAULT


def _as_typed(message: str, target: str, url: str) -> str:
    """``message`` naming ``url`` as the user typed it where it names the ``target`` opened
    (``url`` with ``migrate=false`` added): the user did not write that query."""
    return message.replace(oncely.redact(target), oncely.redact(url))


def refuse_missing_directory(url: str) -> None:
    """Exit 3 for a SQLite database in a directory that does not exist: it cannot be opened,
    and SQLite would say only "unable to open database file" (the library's
    ConfigurationError, with the same words, would be a usage error)."""
    path = _sqlite_path(url)
    missing = missing_directory(path) if path is not None else None
    if missing is not None:
        raise CliError(str(missing), STORE_UNAVAILABLE)


@contextmanager
def opened(url: str, *, create: bool = False) -> Iterator[Store]:
    """The store at ``url``, closed when the block ends.

    Without ``create``, a SQLite file that does not exist is a schema problem (exit 4) whose
    message names the fix; one in a directory that does not exist cannot be opened (exit 3).
    A URL oncely cannot use is a usage error (exit 2).
    """
    remember_secrets(url)
    target = url
    try:
        target = url if create else _without_auto_migrate(url)
        store = oncely.open(target)
        _named_as_typed(store, target, url)
    except ConfigurationError as exc:
        message = _as_typed(str(exc), target, url)
        raise click.BadParameter(message, param_hint="'--store'") from None
    except ValueError as exc:
        # urlsplit's own complaint (a malformed host); the URL itself is not repeated here
        # because it could not be parsed, hence not redacted.
        raise click.BadParameter(f"not a valid URL ({exc})", param_hint="'--store'") from None
    try:
        refuse_missing_directory(url)
        path = _sqlite_path(url)
        if not create and path is not None and not os.path.exists(path):
            if _defaulted():
                # An operator who forgot --store: creating this file would not help them.
                raise CliError(
                    f"no --store given and ${ENV_STORE} is not set, so the default "
                    f"{DEFAULT_STORE} was used, and there is no {path} in "
                    f"{os.getcwd()}: give the consumer's store with --store URL (or "
                    f"${ENV_STORE})",
                    SCHEMA,
                )
            raise CliError(
                f"no SQLite database at {path}; create it with "
                f"`oncely migrate --store {oncely.redact(url)}`",
                SCHEMA,
            )
        yield store
    except OncelyError as exc:
        if target != url and len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (_as_typed(exc.args[0], target, url),)
        raise
    finally:
        store.close()
