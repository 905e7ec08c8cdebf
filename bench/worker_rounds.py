"""What the worker benchmarks (Celery, Dramatiq, FastStream, taskiq) share: variants run in
rounds with a rotating order, medians, and the table written to ``bench/results``."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path


def rotating_rounds(
    variants: Sequence[str], rounds: int, one_round: Callable[[str], float]
) -> dict[str, float]:
    """Each variant's median rate over ``rounds`` rounds, the order rotated every round so no
    variant always runs first (a cold broker) or last."""
    rates: dict[str, list[float]] = {v: [] for v in variants}
    n = len(variants)
    for r in range(rounds):
        for variant in [*variants[r % n :], *variants[: r % n]]:
            rate = one_round(variant)
            rates[variant].append(rate)
            print(f"  {variant:<8} {rate:8,.0f} msg/s", flush=True)
    return {v: statistics.median(x) for v, x in rates.items()}


def write_table(
    med: dict[str, float],
    *,
    title: str,
    command: str,
    setup: str,
    out: Path,
    name: str,
    effect: str = "one Redis INCR",
) -> None:
    """Print the medians against ``by hand`` and write them to ``out/name``."""
    lines = [
        "| variant | msg/s | cost against by hand |",
        "|---|---:|---:|",
        *(f"| {v} | {rate:,.0f} | {med['by hand'] / rate:.2f}x |" for v, rate in med.items()),
    ]
    text = (
        f"# {title}\n\n`{command.strip()}`, {setup}; medians. The effect is {effect}; "
        "cost is by hand's rate over the variant's.\n\n" + "\n".join(lines) + "\n"
    )
    print("\n" + "\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
