"""``pip install oncely`` with no extras, in a fresh virtual environment: the core needs
nothing beyond the standard library, and whatever needs an extra says which at first use."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

CORE = textwrap.dedent(
    """
    import importlib.util, sys, tempfile, os
    import oncely

    for name in ("aiosqlite", "psycopg", "pymysql", "redis", "click", "aio_pika", "nats"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: not a core venv"

    def charge(payment):
        return {"charged": payment["amount"]}

    with tempfile.TemporaryDirectory() as tmp:
        for store in (oncely.MemoryStore(), oncely.SQLiteStore(os.path.join(tmp, "o.db")),
                      oncely.open("sqlite:///" + os.path.join(tmp, "u.db"))):
            inbox = oncely.Inbox(store, consumer="billing")
            first = inbox.handle("p-1", {"amount": 5}, charge)
            again = inbox.handle("p-1", {"amount": 5}, charge)
            assert (first.outcome, again.outcome) == ("processed", "duplicate"), (first, again)
            assert again.value == {"charged": 5}
            inbox.close()

    def hint(call):
        try:
            call()
        except (ImportError, oncely.ConfigurationError) as exc:
            return str(exc)
        raise AssertionError("no error")

    print(hint(lambda: oncely.AsyncSQLiteStore))
    print(hint(lambda: oncely.PostgresStore))
    print(hint(lambda: oncely.open("postgresql://db/app")))
    print(hint(lambda: oncely.open("redis://localhost/0")))
    print(hint(lambda: __import__("oncely.brokers.rabbitmq")))
    """
)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def test_the_core_installs_and_runs_with_the_standard_library_alone(core_venv: Path) -> None:
    done = subprocess.run(
        [str(core_venv / "bin" / "python"), "-c", CORE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=core_venv,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    hints = done.stdout.splitlines()
    assert "pip install 'oncely[sqlite]'" in hints[0], hints
    assert "pip install 'oncely[postgres]'" in hints[1], hints
    assert "pip install 'oncely[postgres]'" in hints[2], hints
    assert "pip install 'oncely[redis]'" in hints[3], hints
    assert "pip install 'oncely[rabbitmq]'" in hints[4], hints


def test_the_oncely_command_without_the_cli_extra_says_how_to_install_it(
    core_venv: Path,
) -> None:
    done = subprocess.run(
        [str(core_venv / "bin" / "oncely"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'oncely[cli]'" in done.stderr
    assert "Traceback" not in done.stderr
