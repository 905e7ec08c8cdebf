"""The README's tour, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_r1_quickstart_applies_each_effect_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "transactional, delivery 1: processed {'booked': 42}",
        "transactional, delivery 2: duplicate {'booked': 42}",
        "two-phase, delivery 1: processed 'receipt for pay-1'",
        "two-phase, delivery 2: duplicate 'receipt for pay-1'",
        "reused key, changed amount: key_conflict -> dead_letter",
        "ledger rows: 1, receipts sent: 1",
    ]
