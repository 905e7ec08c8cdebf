"""The ``oncely`` command: run the demo, migrate a store, inspect and purge records, and size
retention for a broker.

Commands::

    oncely demo       the same duplicate-laden traffic through a naive consumer and oncely
    oncely consume    run a broker consumer: a handler (module:function) once per message
    oncely migrate    create or upgrade the store's tables
    oncely inbox      stats | list | show | purge | forget | resolve: the dedup records
    oncely reconcile  settle a consumer's stale claims now, with its reconciler (R10)
    oncely retention  the redelivery horizon of a broker and the retention it needs (R13)

The store comes from ``--store URL``, else the ``ONCELY_STORE`` environment variable, else
``sqlite:///oncely.db``. This package is the only place in oncely that reads environment
variables. Passwords in URLs are never printed (:func:`oncely.redact`).

Exit codes:

== =====================================================================================
0  success
1  a check failed: the demo's self-check, a retention shorter than the horizon, or the
   record asked for does not exist
2  usage error: a bad option, duration or store URL
3  the store is unavailable (cannot be opened or stayed locked); retrying later is safe
4  schema problem: the tables are missing (run ``oncely migrate``), were written by a
   newer oncely (upgrade oncely), or a table's schema marker was deleted (restore it)
5  any other oncely or store error
6  the broker refused the consumer (``oncely consume``: wrong credentials, no such vhost)
== =====================================================================================

Errors go to stderr as one line; ``oncely --debug ...`` shows the traceback instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oncely.cli._app import cli as cli

__all__ = ["cli", "main"]

INSTALL_HINT = "the oncely command needs the cli extra: pip install 'oncely[cli]'"
_CLI_PACKAGES = ("click", "rich")


def main(args: Sequence[str] | None = None) -> None:
    """The ``oncely`` executable. Exits with the codes listed in the module docstring; without
    the ``cli`` extra it says how to install it and exits 2."""
    try:
        from oncely.cli._app import main as run  # noqa: PLC0415 - click may be missing
    except ModuleNotFoundError as exc:
        if exc.name not in _CLI_PACKAGES:
            raise
        print(f"oncely: {INSTALL_HINT} (no module named {exc.name!r})", file=sys.stderr)
        raise SystemExit(2) from None
    run(args)


def __getattr__(name: str) -> object:
    if name == "cli":
        from oncely.cli._app import cli as group  # noqa: PLC0415 - imported on first use

        return group
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
