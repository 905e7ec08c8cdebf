"""``oncely demo``: the self-check rules, and the demo engine ``oncely.demo`` run for real.

The tests named ``test_demo_*`` (marked DEMO below) run the demo engine, which is written
separately; without it they fail with "the demo is not available".
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from oncely.cli import cli
from oncely.cli._demo import self_check
from tests.cli.helpers import EXECUTABLE, SECRET, run

# --------------------------------------------------------------------------- the demo


def test_demo_self_check_rules() -> None:
    clean = {
        "naive": {"extra_effects": 12, "lost": 0},
        "oncely-transactional": {"extra_effects": 0, "lost": 0},
        "oncely-two-phase": {"extra_effects": 0, "lost": 0},
    }
    assert self_check(clean) == []
    assert self_check({**clean, "oncely-two-phase": {"extra_effects": 1, "lost": 0}}) == [
        "oncely-two-phase: extra_effects=1"
    ]
    assert self_check({**clean, "oncely-transactional": {"extra_effects": 0, "lost": 2}}) == [
        "oncely-transactional: lost=2"
    ]
    assert self_check({"naive": clean["naive"]}) == [
        "oncely-transactional: missing from the report",
        "oncely-two-phase: missing from the report",
    ]
    assert self_check({**clean, "oncely-extra": {"lost": 0}}) == [
        "oncely-extra: extra_effects=None"
    ]


# DEMO: the tests below run the real demo engine (oncely.demo, written separately). Without it
# they fail with "the demo is not available in this installation". Each run takes a
# few seconds (worker processes, a SIGKILL, an expired lock), so there are only two.

DEMO = ("demo", "--messages", "40", "--workers", "2", "--seed", "7")


def test_demo_json_keep_with_the_real_executable(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("ONCELY_STORE", None)
    done = subprocess.run(
        [str(EXECUTABLE), *DEMO, "--json", "--keep"], capture_output=True, text=True, env=env,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # exactly one JSON document on stdout, nothing else
    assert {"naive", "oncely-transactional", "oncely-two-phase"} <= set(report)
    for name in ("oncely-transactional", "oncely-two-phase"):
        assert report[name]["extra_effects"] == 0
        assert report[name]["lost"] == 0
    assert report["naive"]["extra_effects"] > 0  # the duplicates were real
    line = next(x for x in done.stderr.splitlines() if x.startswith("work directory kept: "))
    workdir = Path(line.removeprefix("work directory kept: "))
    assert workdir.is_dir()
    assert workdir.parent == tmp_path


def test_demo_table_and_cleanup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run(*DEMO)
    assert result.exit_code == 0, result.stderr
    for name in ("naive", "oncely-transactional", "oncely-two-phase"):
        assert name in result.stdout
    assert "self-check passed" in result.stdout
    assert list(tmp_path.iterdir()) == []  # without --keep the work directory is gone


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--store", "memory://"], "memory://"),
        (["--store", f"postgresql://admin:{SECRET}@db/app"], "SQLite store"),
        (["--messages", "5"], "5 is not in the range x>=12"),
    ],
)
def test_demo_refuses_options_it_cannot_run(args: list[str], says: str) -> None:
    result = run("demo", *args)
    assert result.exit_code == 2, result.stderr
    assert says in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_demo_defaults_are_the_engines() -> None:
    from oncely.demo import DemoOptions

    defaults = DemoOptions()
    params = {p.name: p.default for p in cli.commands["demo"].params}
    assert (params["messages"], params["workers"], params["seed"]) == (
        defaults.messages,
        defaults.workers,
        defaults.seed,
    )
