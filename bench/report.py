"""Reporting for ``bench/run.py``: the text and Markdown tables (the chart is in ``charts.py``)."""

from __future__ import annotations

import contextlib
import os
import platform
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
from cases import TARGET_CORE_US, TARGET_TX_RATIO, med
from servers_report import server_tables

import oncely

# --------------------------------------------------------------------------- reporting


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "aiosqlite": getattr(aiosqlite, "__version__", "?"),
        "oncely": oncely.__version__,
        "load_before": os.getloadavg(),
    }


def fmt_us(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def fmt_rate(us: float) -> str:
    return f"{1e6 / us:,.0f}"


def spread(values: Sequence[float]) -> str:
    return f"{fmt_us(min(values))}-{fmt_us(max(values))}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    left: tuple[int, ...] = (0,)  # columns of text; the others are numbers, right-aligned

    def text(self) -> str:
        widths = [
            max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
            for i, h in enumerate(self.headers)
        ]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                c.ljust(w) if i in self.left else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        out = [self.title, line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [f"### {self.title}", "", "| " + " | ".join(self.headers) + " |"]
        aligns = [" --- " if i in self.left else " ---: " for i in range(len(self.headers))]
        out.append("|" + "|".join(aligns) + "|")
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


def tables(results: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    rounds = results["rounds"]
    n = results["messages"]
    if "twophase" in results:
        trace = results.get("twophase_trace", {})
        rows = []
        for row in results["twophase"]:
            us = row["us"]
            t = trace.get(row["path"]) if "SQLite" in row["store"] else None
            sql = f"{t['statements']:.0f} / {t['commits']:.0f}" if t else "-"
            rows.append(
                [row["store"], row["path"], fmt_rate(med(us)), fmt_us(med(us)), spread(us), sql]
            )
        out.append(
            Table(
                "1. Two-phase mode: Inbox.handle / AsyncInbox.handle, trivial handler",
                ["store", "path", "msg/s", "us/msg", "range over rounds", "SQL stmts / write txns"],
                rows,
                [
                    f"median of {rounds} rounds of {n} messages; new key = claim + handler + "
                    "complete; duplicate = the same keys again (stored result returned)",
                    "(full)/(normal): SQLiteSettings(synchronous=...); full is the default "
                    "(a WAL fsync per commit)",
                    "SQL per message: see the SQL table below",
                ],
                left=(0, 1),
            )
        )
    if "tx" in results:
        rows = []
        target_ok = True
        for row in results["tx"]:
            ratio = med(row["ratios"])
            target_ok &= ratio <= TARGET_TX_RATIO
            rows.append(
                [
                    row["config"],
                    fmt_us(med(row["raw"])),
                    fmt_us(med(row["marker"])),
                    fmt_us(med(row["oncely"])),
                    fmt_rate(med(row["oncely"])),
                    fmt_us(med(row["prefp"])),
                    f"{med(row['marker_ratios']):.2f}x",
                    f"{med(row['prefp_ratios']):.2f}x",
                    f"{ratio:.2f}x",
                    f"{min(row['ratios']):.2f}-{max(row['ratios']):.2f}",
                    "yes" if ratio <= TARGET_TX_RATIO else "NO",
                ]
            )
        out.append(
            Table(
                "2. Transactional mode vs the same SQLite transaction without oncely",
                [
                    "driver / synchronous",
                    "raw us/msg",
                    "raw+marker us/msg",
                    "oncely us/msg",
                    "oncely msg/s",
                    "oncely, fp precomputed us/msg",
                    "marker/raw",
                    "fp precomputed/raw",
                    "oncely/raw",
                    "oncely/raw range",
                    f"<= {TARGET_TX_RATIO}x",
                ],
                rows,
                [
                    "raw = BEGIN IMMEDIATE; INSERT ledger; UPDATE account; COMMIT by hand "
                    "(sqlite3 / aiosqlite), WAL, same pragmas as the store",
                    "raw+marker = raw plus oncely's claim statement run by hand (no oncely "
                    "Python): the SQL share of the overhead",
                    "oncely = Inbox.handle_in_transaction(key, payload, handler) with the same "
                    "INSERT + UPDATE in the handler",
                    "oncely, fp precomputed = the same with a fingerprinter that returns the "
                    "marker variant's precomputed fingerprint: the same row and statements, all "
                    "of oncely's Python but the fingerprint's (its share of the overhead)",
                    f"ratios: median of per-round ratios over {rounds} interleaved rounds of "
                    f"{n} messages (rotating order)",
                    f"target: oncely/raw <= {TARGET_TX_RATIO}x on SQLite: "
                    + ("met in every configuration" if target_ok else "NOT met everywhere"),
                ],
            )
        )
    sql_rows = []
    names = {"raw": "tx: raw floor", "marker": "tx: raw + marker", "oncely": "tx: oncely"}
    for v, t in results.get("tx_trace", {}).items():
        sql_rows.append(sql_row(names[v], t))
    for path, t in results.get("twophase_trace", {}).items():
        sql_rows.append(sql_row(f"two-phase: {path}", t))
    if sql_rows:
        out.append(
            Table(
                "SQL per message (sync, traced with sqlite3's trace callback)",
                ["path", "statements", "write txns", "WAL pages", "sequence"],
                sql_rows,
                [
                    "write txns: COMMITs plus autocommit INSERT/UPDATE/DELETE statements; each "
                    "one that wrote pages is a WAL fsync at synchronous=full",
                    "WAL pages: 4 KiB pages appended to the WAL per message (the write volume); "
                    "0 means the write transaction changed nothing and needed no fsync",
                    "the async stores run the same generated statements",
                ],
                left=(0, 4),
            )
        )
    if "core" in results:
        rows = []
        for row in results["core"]:
            us = row["us"]
            rows.append([row["step"], f"{med(us):.2f}", spread_f(us)])
        total = med(results["core"][-1]["us"])
        out.append(
            Table(
                "3. Pure-core decision path per message",
                ["step", "us/msg", "range"],
                rows,
                [
                    f"median of {rounds} rounds over {results['core_n']} messages",
                    f"target: total under {TARGET_CORE_US:.0f} us: "
                    + ("met" if total < TARGET_CORE_US else "NOT met")
                    + f" ({total:.2f} us)",
                ],
            )
        )
    if "servers" in results:
        out += server_tables(results, Table)
    return out


def sql_row(name: str, t: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{t['statements']:.0f}",
        f"{t['commits']:.0f}",
        f"{t['wal_pages']:.1f}",
        "; ".join(t["seq"]),
    ]


def spread_f(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def machine_text(m: dict[str, Any]) -> str:
    la, lb = m["load_before"], m.get("load_after", m["load_before"])
    return (
        f"machine: {m['cpus']} CPUs ({m['cpu']}), {m['os']}\n"
        f"Python {m['python']}, SQLite {m['sqlite']}, aiosqlite {m['aiosqlite']}, "
        f"oncely {m['oncely']}\n"
        f"load average (1 min) before/after: {la[0]:.2f} / {lb[0]:.2f}"
        + (
            " -- the machine was busy: absolute numbers are noisy"
            if max(la[0], lb[0]) > 0.5
            else ""
        )
    )


def write_markdown(path: Path, results: dict[str, Any], ts: list[Table]) -> None:
    m = results["machine"]
    lines = [
        "# oncely benchmark: latest run",
        "",
        f"- command: `{results['command']}`",
        f"- date: {results['date']}",
        f"- sections: {', '.join(results['sections'])}; {results['messages']} messages per batch, "
        f"{results['rounds']} rounds, {results['warmup']} warm-up messages",
        f"- machine: {m['cpus']} CPUs ({m['cpu']}), {m['os']}",
        f"- Python {m['python']}, SQLite {m['sqlite']}, aiosqlite {m['aiosqlite']}, "
        f"oncely {m['oncely']}",
        f"- load average (1 min) before/after: {m['load_before'][0]:.2f} / "
        f"{m['load_after'][0]:.2f}",
        f"- database files in: {results['dir_fs']}",
        *(
            [f"- servers section: {results['server_messages']} messages per batch"]
            if "servers" in results
            else []
        ),
        "",
        "See `bench/README.md` for what each figure means. Chart: `latest.png`.",
        "",
    ]
    for t in ts:
        lines += [t.markdown(), ""]
    path.write_text("\n".join(lines))


def filesystem_of(path: Path) -> str:
    with contextlib.suppress(OSError):
        best = ("", "?")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, f"{fstype} on {dev}")
        return f"{path} ({best[1]})"
    return str(path)
