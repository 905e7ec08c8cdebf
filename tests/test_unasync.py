"""The generator of the sync twin: what it rewrites, and that the committed output is current."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import unasync  # noqa: E402


def test_rewrites_async_syntax_and_names() -> None:
    source = (
        "from oncely.stores.async_protocols import AsyncStore\n"
        '__all__ = ["AsyncInbox"]\n'
        "class AsyncInbox:\n"
        "    async def handle(self, fn: Callable[[P], Awaitable[dict[str, R]]]) -> None:\n"
        "        async with self._lock:\n"
        "            value = await fn(await self.store.get('k'))  # await stays in comments\n"
        "        async for item in aiosqlite.rows():\n"
        "            pass\n"
        "    async def aclose(self) -> None:\n"
        "        await asyncio.sleep(0)\n"
    )
    assert unasync.rewrite(source) == (
        "from oncely.stores.sync_protocols import Store\n"
        '__all__ = ["Inbox"]\n'
        "class Inbox:\n"
        "    def handle(self, fn: Callable[[P], dict[str, R]]) -> None:\n"
        "        with self._lock:\n"
        "            value = fn(self.store.get('k'))  # await stays in comments\n"
        "        for item in sqlite3.rows():\n"
        "            pass\n"
        "    def close(self) -> None:\n"
        "        threading.sleep(0)\n"
    )


def test_f_strings_are_rewritten_alike_on_every_python() -> None:
    # Python 3.12+ tokenizes an f-string into parts (PEP 701), 3.11 as one string: the
    # class names in its text are renamed on both, so the twins never depend on the Python
    # that generated them (`make lint` on 3.13 once found sync_inbox.py stale).
    source = (
        "def describe(self) -> str:\n"
        '    return f"<AsyncClaimed {self.key!r} {f\'{AsyncInbox.__name__}\'} [{x[0]}]>"\n'
        "async def after() -> None:\n"
        "    await asyncio.sleep(0)\n"
    )
    assert unasync.rewrite(source) == (
        "def describe(self) -> str:\n"
        '    return f"<Claimed {self.key!r} {f\'{Inbox.__name__}\'} [{x[0]}]>"\n'
        "def after() -> None:\n"
        "    threading.sleep(0)\n"
    )


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "unasync.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_marked_differences_keep_the_sync_side() -> None:
    source = (
        "from oncely._twin import ASYNC\n"
        "if ASYNC:\n"
        "    import asyncio\n"
        "else:\n"
        "    import threading\n"
        "class Pool:\n"
        "    async def get(self) -> int:\n"
        "        if ASYNC:\n"
        "            await asyncio.sleep(0)  # only asyncio needs a turn\n"
        "        n = 1\n"
        "        if ASYNC:\n"
        "            return n\n"
        "        else:\n"
        "            if n:\n"
        "                return n + 1\n"
        "            return 0\n"
        "    if ASYNC:\n"
        "        @property\n"
        "        def loop(self) -> object:\n"
        "            return asyncio.get_running_loop()\n"
    )
    assert unasync.unmark(source) == (
        "import threading\n"
        "class Pool:\n"
        "    async def get(self) -> int:\n"
        "        n = 1\n"
        "        if n:\n"
        "            return n + 1\n"
        "        return 0\n"
    )


def test_make_lint_fails_on_a_stale_twin(tmp_path: Path) -> None:
    """The check CI runs (``make lint`` calls ``tools/unasync.py --check``) fails when an async
    source changed and its twin was not regenerated, or a twin was edited by hand."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    shutil.copytree(ROOT / "tools", copy / "tools")
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(copy / "tools" / "unasync.py"), "--check"],
            capture_output=True,
            text=True,
            check=False,
            cwd=copy,
        )

    assert check().returncode == 0, check().stdout
    source = copy / "src" / "oncely" / "stores" / "memory" / "async_store.py"
    source.write_text(source.read_text() + "\n\nLIMIT = 1\n")
    stale = check()
    assert stale.returncode == 1
    assert "oncely/stores/memory/sync_store.py" in stale.stdout
    subprocess.run(
        [sys.executable, str(copy / "tools" / "unasync.py")],
        check=True,
        cwd=copy,
        capture_output=True,
    )
    assert check().returncode == 0
    twin = copy / "src" / "oncely" / "inbox" / "sync_inbox.py"
    twin.write_text(twin.read_text().replace("def handle(", "def handle_(", 1))
    edited = check()
    assert edited.returncode == 1 and "oncely/inbox/sync_inbox.py" in edited.stdout


def test_the_sync_side_of_a_marked_block_is_left_as_written() -> None:
    source = (
        "if ASYNC:\n"
        "    NAME = 'AsyncInbox'\n"
        "else:\n"
        "    NAME = 'Inbox, not AsyncInbox'  # sync code already: not rewritten\n"
        "def run_async(inbox: AsyncInbox) -> None: ...\n"
    )
    assert unasync.rewrite(unasync.unmark(source, fence=True)) == (
        "NAME = 'Inbox, not AsyncInbox'  # sync code already: not rewritten\n"
        "def run(inbox: Inbox) -> None: ...\n"
    )


def test_every_sync_module_is_generated_from_an_async_one() -> None:
    """No hand-kept twin: each sync_<name>.py has an async_<name>.py beside it and was
    written by the generator (the check above proves it is current)."""
    package = ROOT / "src" / "oncely"
    twins = sorted(package.rglob("sync_*.py"))
    assert len(twins) >= 20  # the stores, the inbox, the integrations, the contract suite
    for twin in twins:
        assert twin.with_name("async_" + twin.name.removeprefix("sync_")).exists(), twin
        assert twin.read_text().startswith("# Generated by tools/unasync.py"), twin
