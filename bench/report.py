"""Reporting for ``bench/run.py``: the text and Markdown tables and the PNG chart."""

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
from matplotlib.figure import Figure
from servers_report import server_chart, server_tables

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
                    f"{med(row['marker_ratios']):.2f}x",
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
                    "marker/raw",
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
                    f"ratios: median of per-round ratios over {rounds} interleaved rounds of "
                    f"{n} messages (rotating order)",
                    f"target (issue): oncely/raw <= {TARGET_TX_RATIO}x on SQLite: "
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


def chart(path: Path, results: dict[str, Any]) -> None:
    sqlite_sections = any(k in results for k in ("twophase", "tx", "core"))
    servers = "servers" in results and bool(results["servers"]["rows"])
    rows = (2 if sqlite_sections or not servers else 0) + (1 if servers else 0)
    fig = Figure(figsize=(15, 5.25 * rows))
    axes = fig.subplots(rows, 2, squeeze=False)
    fig.suptitle(
        f"oncely benchmark  ({results['date']}, {results['machine']['cpus']} CPUs, "
        f"Python {results['machine']['python']}, SQLite {results['machine']['sqlite']}, "
        f"load {results['machine']['load_before'][0]:.1f})",
        fontsize=12,
    )
    if rows != 1:
        sqlite_panels(axes, results)
    if servers:
        server_chart(axes[-1][0], axes[-1][1], results)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sqlite_panels(axes: Any, results: dict[str, Any]) -> None:
    """The SQLite sections' four panels (two-phase, transactional time and ratio, core)."""
    ax = axes[0][0]
    if "twophase" in results:
        stores = list(dict.fromkeys(r["store"] for r in results["twophase"]))
        newv = [med(r["us"]) for r in results["twophase"] if r["path"] == "new key"]
        dupv = [med(r["us"]) for r in results["twophase"] if r["path"] == "duplicate"]
        ys = range(len(stores))
        h = 0.38
        b1 = ax.barh([y - h / 2 for y in ys], newv, h, label="new key", color="#3b75af")
        b2 = ax.barh([y + h / 2 for y in ys], dupv, h, label="duplicate", color="#9ecae1")
        ax.set_yticks(list(ys), stores)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("µs per message (log scale; lower is better)")
        ax.set_title("1. Two-phase mode (Inbox.handle)")
        for bars in (b1, b2):
            ax.bar_label(bars, labels=[fmt_us(b.get_width()) for b in bars], padding=3, fontsize=8)
        ax.set_xlim(right=max(newv + dupv) * 4)
        ax.legend(loc="lower right")
    else:
        not_run(ax, "two-phase")

    if "tx" in results:
        rows = results["tx"]
        names = [r["config"] for r in rows]
        ax = axes[0][1]
        xs = range(len(rows))
        w = 0.27
        parts = (
            ("raw", "raw floor", "#bbbbbb"),
            ("marker", "raw + marker SQL", "#f2a65a"),
            ("oncely", "oncely", "#3b75af"),
        )
        for i, (k, lab, color) in enumerate(parts):
            vals = [med(r[k]) for r in rows]
            bars = ax.bar([x + (i - 1) * w for x in xs], vals, w, label=lab, color=color)
            ax.bar_label(bars, labels=[fmt_us(v) for v in vals], padding=2, fontsize=7)
        ax.set_xticks(list(xs), names)
        ax.set_yscale("log")
        ax.set_ylabel("µs per message (log scale)")
        ax.set_title("2. Transactional mode: time per message")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_ylim(
            bottom=min(med(r["raw"]) for r in rows) * 0.4,
            top=max(med(r["oncely"]) for r in rows) * 4,
        )

        ax = axes[1][0]
        ratios = [med(r["ratios"]) for r in rows]
        mratios = [med(r["marker_ratios"]) for r in rows]
        b1 = ax.bar([x - 0.2 for x in xs], mratios, 0.4, label="raw+marker / raw", color="#f2a65a")
        b2 = ax.bar([x + 0.2 for x in xs], ratios, 0.4, label="oncely / raw", color="#3b75af")
        for bars, vals in ((b1, mratios), (b2, ratios)):
            ax.bar_label(bars, labels=[f"{v:.2f}x" for v in vals], padding=2, fontsize=9)
        ax.axhline(
            TARGET_TX_RATIO,
            color="#c0392b",
            linestyle="--",
            linewidth=1,
            label=f"target: oncely/raw <= {TARGET_TX_RATIO}x",
        )
        ax.axhline(1.0, color="#555555", linewidth=0.8)
        ax.set_xticks(list(xs), names)
        ax.set_ylim(0, max([*ratios, *mratios, TARGET_TX_RATIO]) * 1.25)
        ax.set_ylabel("time per message relative to the raw floor")
        ax.set_title("2. Transactional mode: overhead ratio (median of interleaved rounds)")
        ax.legend(loc="upper left", fontsize=8)
    else:
        not_run(axes[0][1], "transactional")
        not_run(axes[1][0], "transactional")

    ax = axes[1][1]
    if "core" in results:
        rows = results["core"]
        names = [r["step"].replace(" (", "\n(").replace(": ", ":\n") for r in rows]
        vals = [med(r["us"]) for r in rows]
        colors = ["#9ecae1"] * (len(rows) - 1) + [
            "#3b75af" if vals[-1] < TARGET_CORE_US else "#c0392b"
        ]
        bars = ax.barh(range(len(rows)), vals, color=colors)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals], padding=3, fontsize=9)
        ax.axvline(
            TARGET_CORE_US,
            color="#c0392b",
            linestyle="--",
            linewidth=1,
            label=f"target: total under {TARGET_CORE_US:.0f} µs",
        )
        ax.legend(loc="lower right", fontsize=8)
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max([*vals, TARGET_CORE_US]) * 1.2)
        ax.set_xlabel("µs per message")
        ax.set_title("3. Pure-core decision path")
    else:
        not_run(ax, "core")


def not_run(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not run (--only)", ha="center", va="center")
    ax.set_axis_off()


def filesystem_of(path: Path) -> str:
    with contextlib.suppress(OSError):
        best = ("", "?")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, f"{fstype} on {dev}")
        return f"{path} ({best[1]})"
    return str(path)
