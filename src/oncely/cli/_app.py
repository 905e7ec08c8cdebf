"""The ``oncely`` command group and its subcommands (needs ``oncely[cli]``: click and rich)."""

from __future__ import annotations

from collections.abc import Sequence

import click

import oncely
from oncely.cli._consume import consume
from oncely.cli._demo import demo
from oncely.cli._errors import OncelyGroup, enable_debug
from oncely.cli._inbox import inbox
from oncely.cli._migrate import migrate
from oncely.cli._operate import reconcile, resolve
from oncely.cli._retention import retention

__all__ = ["cli", "main"]

_EPILOG = """\b
Exit codes:
  0  success
  1  a check failed (demo self-check, retention too short, no such record)
  2  usage error (bad option, duration or store URL)
  3  store unavailable (cannot open it, or it stayed locked): retry later
  4  schema problem: tables missing (run `oncely migrate`), too new (upgrade oncely),
     or a table's schema marker missing (the error says how to restore it)
  5  any other oncely or store error
  6  the broker refused the consumer (oncely consume: wrong credentials, no such vhost)

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
inbox.add_command(resolve)
cli.add_command(inbox)
cli.add_command(reconcile)
cli.add_command(retention)


def main(args: Sequence[str] | None = None) -> None:
    """The ``oncely`` executable. Exits with the codes listed in the module docstring."""
    cli.main(args=list(args) if args is not None else None, prog_name="oncely")
