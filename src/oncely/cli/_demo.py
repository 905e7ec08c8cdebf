"""``oncely demo``: the same duplicate-laden traffic through a naive consumer and through oncely.

The engine lives in :mod:`oncely.demo` and is imported only when the command runs, so the rest
of the CLI neither pays for it nor depends on it. The demo doubles as a self-check: the command
fails (exit 1) when an oncely consumer repeated an effect or lost a message.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import Final

import click

import oncely
from oncely.cli._errors import CHECK_FAILED, STORE_ERROR, CliError, remember_secrets
from oncely.cli._output import console, echo_json, text
from oncely.demo.run import MIN_MESSAGES

__all__ = ["demo", "self_check"]

ONCELY_CONSUMERS: Final = ("oncely-transactional", "oncely-two-phase")
# Must be zero for every oncely consumer. "unsettled" is checked when the report has it: copies
# left when the run hit its deadline make the other figures inconclusive.
_ZERO: Final = ("extra_effects", "lost")
_ZERO_IF_PRESENT: Final = ("unsettled",)


def self_check(report: Mapping[str, object]) -> list[str]:
    """The problems in a demo report (``report.to_dict()``): every oncely consumer must be
    present with ``extra_effects == 0`` and ``lost == 0`` (and, where reported, no unsettled
    copy and consistent balances). Empty when the check passes."""
    names = list(ONCELY_CONSUMERS)
    names += sorted(n for n in report if n.startswith("oncely") and n not in ONCELY_CONSUMERS)
    problems: list[str] = []
    for name in names:
        figures = report.get(name)
        if not isinstance(figures, Mapping):
            problems.append(f"{name}: missing from the report")
            continue
        for field in _ZERO:
            if figures.get(field) != 0:
                problems.append(f"{name}: {field}={figures.get(field)!r}")
        for field in _ZERO_IF_PRESENT:
            if field in figures and figures[field] != 0:
                problems.append(f"{name}: {field}={figures[field]!r}")
        if figures.get("balances_consistent") is False:
            problems.append(f"{name}: balances_consistent=False")
    return problems


@click.command()
@click.option(
    "--messages",
    type=click.IntRange(min=MIN_MESSAGES),
    default=1000,
    show_default=True,
    help="Logical payments to publish (the broker adds the duplicates).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Competing worker processes per consumer.",
)
@click.option(
    "--seed",
    type=int,
    default=7,
    show_default=True,
    help="Seed of the workload and its faults; the same seed replays the same run.",
)
@click.option(
    "--store",
    "store_url",
    metavar="URL",
    default=None,
    help="SQLite store for the oncely consumers, sqlite:///path.db (default: files in a "
    "temporary work directory; the demo never reads ONCELY_STORE).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--keep", is_flag=True, help="Keep the work directory and print its path.")
def demo(
    messages: int,
    workers: int,
    seed: int,
    store_url: str | None,
    as_json: bool,
    keep: bool,
) -> None:
    """Run one seeded workload of payments, with every duplicate source injected (producer
    retries, lost acks, SIGKILLed workers, expired locks, reused ids), through a naive
    consumer and through oncely's transactional and two-phase consumers; compare the effects.

    The naive consumer applies payments twice. The oncely consumers must show no extra effect
    and no lost message, or the command exits 1: the demo is also a self-check.
    """
    try:
        from oncely.demo import DemoError, DemoOptions, run_demo  # noqa: PLC0415 - lazy
    except ImportError as exc:
        raise CliError(
            f"the demo is not available in this installation: {exc}", STORE_ERROR
        ) from None
    if store_url is not None:
        remember_secrets(store_url)
    options = DemoOptions(
        messages=messages,
        workers=workers,
        seed=seed,
        store_url=store_url,
        workdir=None,  # the engine makes a temporary directory and removes it unless keep
        keep=keep,
    )
    try:
        if as_json:
            # stdout carries exactly one JSON object: anything the engine prints goes to stderr.
            with contextlib.redirect_stdout(sys.stderr):
                report = run_demo(options)
        else:
            report = run_demo(options)
    except DemoError as exc:
        raise CliError(f"the demo could not finish: {exc}", STORE_ERROR) from None
    figures = report.to_dict()
    if as_json:
        echo_json(figures)
        if report.workdir is not None:
            click.echo(f"work directory kept: {report.workdir}", err=True)
    else:
        report.render(console())  # it names the kept work directory itself
    problems = self_check(figures)
    if problems:
        where = f" (store {oncely.redact(store_url)})" if store_url is not None else ""
        raise CliError("self-check failed: " + "; ".join(problems) + where, CHECK_FAILED)
    if not as_json:
        console().print(text("self-check passed: no extra effect, no lost message", "green"))
