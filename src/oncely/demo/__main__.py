"""``python -m oncely.demo [--messages N] [--workers N] [--seed N] [--store URL] [--json]``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from oncely.demo.run import DemoError, DemoOptions, run_demo
from oncely.errors import ConfigurationError

__all__ = ["main"]


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oncely.demo",
        description="Feed one seeded, duplicate-ridden workload to a naive consumer and to "
        "oncely's two modes, and report the effects each one applied.",
    )
    defaults = DemoOptions()
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--store", metavar="URL", help="sqlite:///path.db (default: a temp file)")
    parser.add_argument("--workdir", help="keep the databases in this directory")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # A terminated run still kills its workers and removes its temporary files.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        options = DemoOptions(
            messages=args.messages,
            workers=args.workers,
            seed=args.seed,
            store_url=args.store,
            workdir=args.workdir,
            keep=args.keep,
        )
        report = run_demo(options)
    except (ConfigurationError, DemoError, ValueError) as exc:
        print(f"oncely demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console  # noqa: PLC0415 - rich is only needed for the table

        report.render(Console())
    # The naive consumer's extra effects are the point of the demo; an oncely consumer's are a
    # failure (R1), as is any message lost or left unsettled.
    failed = any(
        r.lost or r.unsettled or (r.extra_effects and r.consumer != "naive")
        for r in report.consumers.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
