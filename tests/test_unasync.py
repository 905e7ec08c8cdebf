"""The generator of the sync twin: what it rewrites, and that the committed output is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import unasync  # noqa: E402


def test_rewrites_async_syntax_and_names() -> None:
    source = (
        "from oncely._async.protocols import AsyncStore\n"
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
        "from oncely._sync.protocols import Store\n"
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


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "unasync.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
