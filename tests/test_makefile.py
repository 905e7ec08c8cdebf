"""The README's two set-up commands, ``make demo`` and ``make test``, on a Python older than
oncely needs: refused with the way out, before a virtual environment is made or used.

Before, a user whose ``python3`` was older than 3.11 got a failing ``pip install`` and a
``.venv`` left behind that every later ``make`` reused. The tests stand in for such a Python
by raising the Makefile's ``MIN_PYTHON`` above the running one, and give ``make`` wrapper
interpreters that refuse to make a venv or run pip (exit 3), so that without the check a run
stops there, offline, instead of installing anything.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

NEWER = "99.0"


def _wrapper(path: Path) -> Path:
    """An interpreter that runs ``-c`` code (the version check) and refuses ``-m`` (venv, pip)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ]; then echo "ran python -m $2" >&2; exit 3; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return path


def _make(goal: str, venv: Path, python: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(ROOT), goal, f"VENV={venv}", f"PYTHON={python}", f"MIN_PYTHON={NEWER}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("goal", ["demo", "test"])
def test_an_old_python_is_refused_before_the_venv_is_made(tmp_path: Path, goal: str) -> None:
    venv = tmp_path / "venv"
    done = _make(goal, venv, _wrapper(tmp_path / "python"))
    assert done.returncode != 0
    assert f"oncely needs Python {NEWER} or newer" in done.stderr
    assert f"make {goal} PYTHON=python{NEWER}" in done.stderr
    assert "ran python -m" not in done.stderr
    assert not venv.exists()


@pytest.mark.parametrize("goal", ["demo", "test"])
def test_a_venv_of_an_old_python_is_refused_with_make_clean(tmp_path: Path, goal: str) -> None:
    venv = tmp_path / "venv"
    _wrapper(venv / "bin" / "python")
    done = _make(goal, venv, _wrapper(tmp_path / "python"))
    assert done.returncode != 0
    assert f"oncely needs Python {NEWER} or newer" in done.stderr
    assert f"make clean, then make {goal} PYTHON=python{NEWER}" in done.stderr
    assert "ran python -m" not in done.stderr  # pip never ran in it


def _smoke(venv: Path, python: Path, min_python: str = "3.11") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(ROOT), "smoke", f"SMOKE_VENV={venv}", f"SMOKE_PYTHON={python}",
         f"MIN_PYTHON={min_python}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_smoke_run_is_skipped_saying_why_without_its_python(tmp_path: Path) -> None:
    """A machine without the newer Python CI's short run uses: ``make smoke`` passes, says
    which interpreter did not run and how to name another, and makes no venv."""
    venv = tmp_path / "smoke"
    missing = tmp_path / "python3.13"  # not there
    done = _smoke(venv, missing)
    assert done.returncode == 0, done.stderr
    assert f"make smoke: skipped, {missing} does not run here" in done.stdout
    assert "SMOKE_PYTHON=" in done.stdout
    assert not venv.exists()


def test_the_smoke_run_refuses_a_python_older_than_oncely_needs(tmp_path: Path) -> None:
    venv = tmp_path / "smoke"
    done = _smoke(venv, _wrapper(tmp_path / "python"), min_python=NEWER)
    assert done.returncode != 0
    assert f"oncely needs Python {NEWER} or newer" in done.stderr
    assert "ran python -m" not in done.stderr
    assert not venv.exists()
