"""The demo's table, printed with rich."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.table import Table

from oncely.stores import redact

if TYPE_CHECKING:
    from rich.console import Console

    from oncely.demo.report import ConsumerReport, DemoReport

__all__ = ["render"]

Row = tuple[str, Callable[["ConsumerReport"], object], bool]

_ROWS: tuple[Row, ...] = (
    ("logical messages", lambda r: r.logical_messages, False),
    ("copies published", lambda r: r.copies_published, False),
    ("deliveries", lambda r: r.deliveries, False),
    ("duplicates delivered", lambda r: r.duplicates_delivered, False),
    ("effects applied", lambda r: r.effects, False),
    ("extra effects", lambda r: r.extra_effects, True),
    ("key conflicts dead-lettered", lambda r: r.key_conflicts_dead_lettered, False),
    ("messages lost", lambda r: r.lost, True),
    ("balances match ledger", lambda r: "yes" if r.balances_consistent else "NO", False),
    ("stale claims reconciled", lambda r: r.reconciled, False),
    ("seconds", lambda r: f"{r.seconds:.1f}", False),
)

_SOURCES: tuple[Row, ...] = (
    ("producer retries delivered", lambda r: r.injected.producer_retries_delivered, False),
    ("acks lost, redelivered", lambda r: r.injected.acks_lost, False),
    ("SIGKILLs before the ack", lambda r: r.injected.workers_killed, False),
    ("expired locks (2 holders)", lambda r: r.injected.expired_locks, False),
    ("twin deliveries", lambda r: r.injected.twin_deliveries, False),
    ("reused ids (changed amount)", lambda r: r.injected.reused_keys_delivered, False),
)


def _table(title: str, rows: tuple[Row, ...], reports: list[ConsumerReport]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for report in reports:
        # "oncely-two-phase" over two lines keeps the table inside 80 columns.
        table.add_column(report.consumer.replace("oncely-", "oncely\n", 1), justify="right")
    for label, get, alarm in rows:
        cells = []
        for report in reports:
            value = get(report)
            bad = alarm and isinstance(value, int) and value > 0
            cells.append(f"[bold red]{value}[/]" if bad else str(value))
        table.add_row(label, *cells)
    return table


def render(report: DemoReport, console: Console) -> None:
    """Print the run: what each consumer did, the injected duplicate sources, a verdict."""
    reports = list(report.consumers.values())
    o = report.options
    console.print(
        _table(
            f"oncely demo: {o.messages} payments, {o.workers} workers per consumer, seed {o.seed}",
            _ROWS,
            reports,
        )
    )
    console.print(_table("duplicate sources injected (broker records)", _SOURCES, reports))
    for r in reports:
        if r.lost or r.unsettled:
            verdict = f"[bold red]{r.lost} lost, {r.unsettled} unsettled[/]"
        elif r.extra_effects:
            verdict = f"[bold red]{r.extra_effects} payments applied more than once[/]"
        else:
            verdict = "[bold green]each payment applied once[/]"
            if r.key_conflicts_dead_lettered:
                n = r.key_conflicts_dead_lettered
                verdict += f", {n} reused id{'' if n == 1 else 's'} dead-lettered"
        console.print(f"  {r.consumer}: {verdict}")
    if o.store_url is not None:
        console.print(
            f"  in {redact(o.store_url)}: consumers demo-{report.run_id}-*, "
            f"tables demo_{report.run_id}_*"
        )
    if report.workdir is not None:
        console.print(f"  databases kept in {report.workdir}")
