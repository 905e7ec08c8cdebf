"""The ``oncely`` command: run the demo, migrate a store, inspect and purge records, and size
retention for a broker.

Commands::

    oncely demo       the same duplicate-laden traffic through a naive consumer and oncely
    oncely consume    run a broker consumer: a handler (module:function) once per message
    oncely migrate    create or upgrade the store's tables
    oncely inbox      stats | list | show | purge | forget: the dedup records of a store
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
4  schema problem: the tables are missing (run ``oncely migrate``) or were written by a
   newer oncely (upgrade oncely)
5  any other oncely or store error
== =====================================================================================

Errors go to stderr as one line; ``oncely --debug ...`` shows the traceback instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

import oncely
from oncely.cli._consume import consume
from oncely.cli._demo import demo
from oncely.cli._errors import OncelyGroup, enable_debug
from oncely.cli._inbox import inbox
from oncely.cli._migrate import migrate
from oncely.cli._retention import retention

__all__ = ["cli", "main"]

_EPILOG = """\b
Exit codes:
  0  success
  1  a check failed (demo self-check, retention too short, no such record)
  2  usage error (bad option, duration or store URL)
  3  store unavailable (cannot open it, or it stayed locked): retry later
  4  schema problem: tables missing (run `oncely migrate`) or too new (upgrade oncely)
  5  any other oncely or store error

\b
The store URL comes from --store, else $ONCELY_STORE, else sqlite:///oncely.db.
Errors are one line on stderr; add --debug for the traceback."""


@click.group(
    name="oncely",
    cls=OncelyGroup,
    epilog=_EPILOG,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(oncely.__version__, prog_name="oncely")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """oncely: effectively-once message processing on at-least-once brokers.

    Run `oncely demo` to watch duplicates hit a naive consumer and miss oncely's.
    """
    enable_debug(ctx, debug)


cli.add_command(demo)
cli.add_command(consume)
cli.add_command(migrate)
cli.add_command(inbox)
cli.add_command(retention)


def main(args: Sequence[str] | None = None) -> None:
    """The ``oncely`` executable. Exits with the codes listed in the module docstring."""
    cli.main(args=list(args) if args is not None else None, prog_name="oncely")
