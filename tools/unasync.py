"""Generate the synchronous twin of oncely's asyncio code.

    python tools/unasync.py           write src/oncely/_sync/<module>.py from src/oncely/_async/
    python tools/unasync.py --check   exit 1 if a generated file is missing or stale

The async code is the source; the sync code is produced by a token-level rewrite that keeps
comments and layout, then formatted with ruff so both trees read alike:

* ``await x`` -> ``x``; ``async def`` / ``async with`` / ``async for`` -> plain;
* ``Awaitable[X]`` -> ``X``;
* the names in ``RENAMES`` (``AsyncInbox`` -> ``Inbox``, ``aiosqlite`` -> ``sqlite3``,
  ``asyncio`` -> ``threading`` for the locks, ``_async`` -> ``_sync`` in imports, ...), and
  the ``Async...`` class names inside strings too (``__all__``, string annotations, docs).

Modules whose sync and async halves really differ are written by hand on both sides (those
whose names start with an underscore); everything else under ``_async`` is generated.
Generated files start with a ``# Generated`` line and must never be edited: CI fails when they
are stale.
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "oncely" / "_async"
TARGET = ROOT / "src" / "oncely" / "_sync"

# Modules whose sync and async halves differ for real are written by hand on both sides: the
# package __init__ and every module whose name starts with an underscore (driver shims such as
# _sqlite_io.py, _concurrency.py, _types.py).


def hand_written(name: str) -> bool:
    return name.startswith("_")


RENAMES = {
    "AsyncInbox": "Inbox",
    "AsyncStoreContract": "StoreContract",
    "AsyncBusiness": "Business",
    "AsyncStore": "Store",
    "AsyncTransactionalStore": "TransactionalStore",
    "AsyncMemoryStore": "MemoryStore",
    "AsyncSQLiteStore": "SQLiteStore",
    "AsyncPostgresStore": "PostgresStore",
    "AsyncMySQLStore": "MySQLStore",
    "AsyncRedisStore": "RedisStore",
    "AsyncHeartbeats": "Heartbeats",
    "AsyncPool": "Pool",
    "AsyncTicket": "Ticket",
    "AsyncTransaction": "Transaction",
    "AsyncHandler": "Handler",
    "AsyncTxHandler": "TxHandler",
    "AsyncFunction": "Function",
    "AsyncReconciler": "Reconciler",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "asynccontextmanager": "contextmanager",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncGenerator": "Generator",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    "aiosqlite": "sqlite3",
    "asyncio": "threading",
    "_async": "_sync",
}


_CLASS_NAMES = re.compile(
    r"\b(" + "|".join(sorted((k for k in RENAMES if "Async" in k), key=len, reverse=True)) + r")\b"
)


def _offsets(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def rewrite(text: str) -> str:
    """The sync version of one async module (before formatting)."""
    starts = _offsets(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))

    def at(pos: tuple[int, int]) -> int:
        return starts[pos[0] - 1] + pos[1]

    edits: list[tuple[int, int, str]] = []
    depth = 0
    closing: list[int] = []  # bracket depths whose "]" closes an Awaitable[...]
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string == "[":
            depth += 1
        elif tok.type == tokenize.OP and tok.string == "]":
            if closing and closing[-1] == depth:
                closing.pop()
                edits.append((at(tok.start), at(tok.end), ""))
            depth -= 1
        if tok.type == tokenize.STRING:
            # Class names inside strings: __all__ entries, string annotations, docstrings.
            renamed = _CLASS_NAMES.sub(lambda m: RENAMES[m.group(0)], tok.string)
            if renamed != tok.string:
                edits.append((at(tok.start), at(tok.end), renamed))
            continue
        if tok.type != tokenize.NAME:
            continue
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.string == "await" or (
            tok.string == "async" and nxt is not None and nxt.string in ("def", "with", "for")
        ):
            assert nxt is not None
            edits.append((at(tok.start), at(nxt.start), ""))
        elif tok.string == "Awaitable" and nxt is not None and nxt.string == "[":
            edits.append((at(tok.start), at(nxt.end), ""))
            closing.append(depth + 1)
        elif tok.string in RENAMES:
            edits.append((at(tok.start), at(tok.end), RENAMES[tok.string]))
    out = text
    for start, end, new in sorted(edits, reverse=True):
        out = out[:start] + new + out[end:]
    return out


def _ruff() -> list[str]:
    exe = (
        shutil.which("ruff", path=str(Path(sys.executable).parent))
        or shutil.which("ruff", path=str(ROOT / ".venv" / "bin"))
        or shutil.which("ruff")
    )
    if exe is None:
        sys.exit("unasync: ruff is needed to format the generated code (pip install ruff)")
    return [exe]


def generate(source: Path) -> str:
    relative = source.relative_to(ROOT).as_posix()
    header = (
        f"# Generated by tools/unasync.py from {relative}.\n"
        "# Do not edit: change the async source and run `make generate`.\n"
    )
    code = header + rewrite(source.read_text(encoding="utf-8"))
    target = TARGET / source.name
    fixed = subprocess.run(
        [*_ruff(), "check", "--fix-only", "--select", "I,F401", "--quiet",
         "--stdin-filename", str(target), "-"],
        input=code, capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    return subprocess.run(
        [*_ruff(), "format", "--quiet", "--stdin-filename", str(target), "-"],
        input=fixed, capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip


def sources() -> list[Path]:
    return sorted(p for p in SOURCE.glob("*.py") if not hand_written(p.name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    stale: list[str] = []
    expected = set()
    for source in sources():
        target = TARGET / source.name
        expected.add(target.name)
        code = generate(source)
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current == code:
            continue
        if args.check:
            stale.append(str(target.relative_to(ROOT)))
        else:
            target.write_text(code, encoding="utf-8")
            print(f"wrote {target.relative_to(ROOT)}")
    for orphan in TARGET.glob("*.py"):
        if orphan.name not in expected and not hand_written(orphan.name):
            text = orphan.read_text(encoding="utf-8")
            if text.startswith("# Generated by tools/unasync.py"):
                stale.append(f"{orphan.relative_to(ROOT)} (its source is gone)")
    if stale:
        print("unasync: stale generated code (run `make generate`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
