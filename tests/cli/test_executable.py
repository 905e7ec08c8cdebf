"""The installed ``oncely`` executable, ``python -m oncely`` and ``python -m oncely.cli``, run as
real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import oncely
from tests.cli.helpers import EXECUTABLE, rows, url_of

# --------------------------------------------------------------- the real executable


def test_installed_executable_help_and_migrate(tmp_path: Path) -> None:
    assert EXECUTABLE.exists(), f"{EXECUTABLE} is missing: pip install -e '.[cli]'"
    helped = subprocess.run(
        [str(EXECUTABLE), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.returncode == 0, helped.stderr
    assert "Exit codes" in helped.stdout
    path = tmp_path / "proc.db"
    env = {**os.environ, "ONCELY_STORE": url_of(path)}
    migrated = subprocess.run(
        [str(EXECUTABLE), "migrate"], capture_output=True, text=True, env=env, timeout=60,
        check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.strip() == f"schema version 2 ready in {url_of(path)}"
    meta = rows(path, "SELECT name, value FROM oncely_inbox_meta ORDER BY name")
    assert meta == [("revision", "3"), ("schema_version", "2")]
    stats = subprocess.run(
        [str(EXECUTABLE), "inbox", "stats", "--json"], capture_output=True, text=True, env=env,
        timeout=60, check=False,
    )  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["total"] == 0


def test_installed_executable_exit_codes(tmp_path: Path) -> None:
    def code(*args: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "ONCELY_STORE"}
        done = subprocess.run(
            [str(EXECUTABLE), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
            timeout=60, check=False,
        )  # fmt: skip
        assert "Traceback" not in done.stderr
        return done.returncode

    assert code("inbox", "stats") == 4  # ./oncely.db does not exist
    assert code("retention", "--max-deliveries", "2", "--lock", "1m", "--message-ttl", "1h",
                "--keep", "1m") == 1  # fmt: skip
    assert code("retention", "--lock", "soon") == 2
    assert code("migrate", "--store", url_of(tmp_path)) == 3


@pytest.mark.parametrize("module", ["oncely.cli", "oncely"])
def test_python_dash_m(module: str) -> None:
    # `python -m oncely` too: tried as a new user would, it said there was no __main__.
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    assert oncely.__version__ in done.stdout
