"""The PNG chart of ``bench/run.py`` (``results/latest.png``): the SQLite sections' four panels
and, when the servers section ran, a third row for the server stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cases import TARGET_CORE_US, TARGET_TX_RATIO, med
from matplotlib.figure import Figure
from report import fmt_us
from server_common import TX_NAMES
from servers import TARGET_FLOOR_RATIO
from servers_report import Row, find, per_round


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


COLORS = {"raw": "#bbbbbb", "oncely": "#3b75af", "Powertools": "#f2a65a"}
SHORT = {"PostgreSQL": "PG", "MariaDB": "Maria"}


def server_chart(left: Any, right: Any, results: dict[str, Any]) -> None:
    """Left: two-phase µs per message per store and path (raw / oncely / Powertools). Right:
    oncely's time relative to its raw floor on every per-message path, against 1.5x."""
    rows: list[Row] = results["servers"]["rows"]
    labels: list[str] = []
    for r in rows:
        if r["kind"] == "twophase":
            name = f"{r['store']} {'new' if r['path'] == 'new key' else 'dup'}"
            if name not in labels:
                labels.append(name)
    variants = [v for v in COLORS if any(r["variant"] == v for r in rows)]
    h = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        ys, vals = [], []
        for y, name in enumerate(labels):
            store, short = name.rsplit(" ", 1)
            path = "new key" if short == "new" else "duplicate"
            r = find(rows, store, "twophase", path, v)
            if r is not None:
                ys.append(y + (i - (len(variants) - 1) / 2) * h)
                vals.append(med(r["us"]))
        bars = left.barh(ys, vals, h, label=v, color=COLORS[v])
        left.bar_label(bars, labels=[fmt_us(x) for x in vals], padding=3, fontsize=7)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    left.set_xscale("log")
    left.set_xlabel("µs per message (log scale; lower is better)")
    left.set_title("4. Server stores, two-phase (Inbox.handle)")
    left.legend(loc="lower right", fontsize=8)
    all_us = [med(r["us"]) for r in rows if r["kind"] == "twophase"]
    if all_us:
        left.set_xlim(left=min(all_us) * 0.5, right=max(all_us) * 4)

    names, ratios = [], []
    for r in rows:
        if r["kind"] == "twophase" and r["variant"] == "oncely":
            store = SHORT.get(r["store"], r["store"])
            names.append(f"{store}\n{'new' if r['path'] == 'new key' else 'dup'}")
            ratios.append(med(r["vs_base"]))
    for r in rows:
        if r["kind"] == "tx" and r["variant"] in (TX_NAMES["own"], TX_NAMES["joined"]):
            marker = find(rows, r["store"], "tx", "new key", TX_NAMES["marker"])
            if marker is not None:
                short = "tx own" if r["variant"] == TX_NAMES["own"] else "tx joined"
                names.append(f"{SHORT.get(r['store'], r['store'])}\n{short}")
                ratios.append(per_round(r["us"], marker["us"]))
    xs = range(len(names))
    colors = ["#3b75af" if v <= TARGET_FLOOR_RATIO else "#c0392b" for v in ratios]
    bars = right.bar(list(xs), ratios, 0.6, color=colors)
    right.bar_label(bars, labels=[f"{v:.2f}x" for v in ratios], padding=2, fontsize=8)
    right.axhline(
        TARGET_FLOOR_RATIO,
        color="#c0392b",
        linestyle="--",
        linewidth=1,
        label=f"target: <= {TARGET_FLOOR_RATIO}x the raw floor",
    )
    right.axhline(1.0, color="#555555", linewidth=0.8)
    right.set_xticks(list(xs), names, fontsize=8)
    right.set_ylim(0, max([*ratios, TARGET_FLOOR_RATIO]) * 1.25)
    right.set_ylabel("oncely time / raw floor (tx: / raw + marker)")
    right.set_title("4-5. Server stores: oncely relative to its raw floor")
    right.legend(loc="upper left", fontsize=8)
