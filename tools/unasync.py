"""Generate the synchronous twin of every asyncio module of oncely.

    python tools/unasync.py           write each sync_<name>.py beside its async_<name>.py
    python tools/unasync.py --check   exit 1 if a generated file is missing or stale

The async code is the source. Every module named ``async_<name>.py`` anywhere under
``src/oncely`` has a twin ``sync_<name>.py`` in the same folder, produced by a token-level
rewrite that keeps comments and layout, then formatted with ruff so both read alike:

* ``await x`` -> ``x``; ``async def`` / ``async with`` / ``async for`` -> plain;
* ``Awaitable[X]`` -> ``X``;
* the names in ``RENAMES`` (``AsyncInbox`` -> ``Inbox``, ``aiosqlite`` -> ``sqlite3``,
  ``asyncio`` -> ``threading`` for the locks, ...), any module name ``async_<name>`` ->
  ``sync_<name>``, any name ``<name>_async`` -> ``<name>`` (``handle_in_session_async``, in
  code and as a whole string, as in ``__all__``), and the ``Async...`` class names inside
  strings too (``__all__``, string annotations, docs); an f-string is one string on every
  Python (3.12+ tokenizes it in parts), its ``{expressions}`` renamed as text, never as code:
  keep an ``await`` out of them;
* the few places where the two really differ are marked in the source::

      if ASYNC:
          <the asyncio code>
      else:
          <the sync code>

  (``from oncely._twin import ASYNC``). The sync twin keeps only the ``else`` part (nothing
  when there is none); mypy reads ``ASYNC`` as always true (``always_true`` in pyproject), so
  the async module is checked as it runs and the sync module, generated, is checked on its own.

Every twin is generated; none is kept by hand. Generated files start with a ``# Generated``
line and must never be edited: ``make lint`` (and so CI) fails when one is stale, and when a
``sync_*.py`` is not generated at all.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "oncely"

RENAMES = {
    "AsyncInbox": "Inbox",
    "AsyncClaimed": "Claimed",
    "AsyncPurgeService": "PurgeService",
    "AsyncStoreContract": "StoreContract",
    "AsyncBusiness": "Business",
    "AsyncStore": "Store",
    "AsyncTransactionalStore": "TransactionalStore",
    "AsyncBoundsResults": "BoundsResults",
    "AsyncCompletesMany": "CompletesMany",
    "AsyncForgetsByToken": "ForgetsByToken",
    "AsyncKeepsOffsets": "KeepsOffsets",
    "AsyncPrepares": "Prepares",
    "AsyncMemoryStore": "MemoryStore",
    "AsyncSQLiteStore": "SQLiteStore",
    "AsyncPostgresStore": "PostgresStore",
    "AsyncMySQLStore": "MySQLStore",
    "AsyncRedisStore": "RedisStore",
    "AsyncDynamoDBStore": "DynamoDBStore",
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
}


_CLASS_NAMES = re.compile(
    r"\b(" + "|".join(sorted((k for k in RENAMES if "Async" in k), key=len, reverse=True)) + r")\b"
)


_ASYNC_MODULE = re.compile(r"(?<=[a-z])\.async_(\w+)")
_ASYNC_NAME = re.compile(r"""^(['"])([A-Za-z_]\w*)_async\1$""")


# The tokens that open and close an f-string on Python 3.12+ (none on 3.11).
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


def _renamed_string(string: str) -> str:
    """A string literal's source with the class names inside renamed (``__all__`` entries,
    string annotations, docstrings); a string that is a whole "<name>_async" is a name too
    (``__all__``), and ``oncely.x.async_y`` a module."""
    renamed = _CLASS_NAMES.sub(lambda m: RENAMES[m.group(0)], string)
    renamed = _ASYNC_NAME.sub(r"\1\2\1", renamed)
    return _ASYNC_MODULE.sub(r".sync_\1", renamed)  # oncely.inbox.async_inbox


def _string_end(tokens: list[tokenize.TokenInfo], start: int) -> int | None:
    """The index of the last token of the string literal that starts at ``tokens[start]``
    (an f-string's closing token: f-strings nest inside its replacement fields); None when
    no string starts there."""
    if tokens[start].type == tokenize.STRING:
        return start
    if tokens[start].type != _FSTRING_START:
        return None
    depth = 0
    for j in range(start, len(tokens)):
        if tokens[j].type == _FSTRING_START:
            depth += 1
        elif tokens[j].type == _FSTRING_END:
            depth -= 1
            if depth == 0:
                return j
    raise SystemExit(f"unasync: line {tokens[start].start[0]}: an f-string without its end")


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
    verbatim = False  # inside sync code an `if ASYNC:` block kept (see unmark)
    depth = 0
    closing: list[int] = []  # bracket depths whose "]" closes an Awaitable[...]
    resume = 0  # the index of the first token after the string just rewritten
    for i, tok in enumerate(tokens):
        if i < resume:
            continue  # inside the f-string just rewritten
        if tok.type == tokenize.COMMENT and tok.string in (_VERBATIM_START, _VERBATIM_END):
            verbatim = tok.string == _VERBATIM_START
            line_start = at((tok.start[0], 0))
            edits.append((line_start, at(tok.end) + 1, ""))  # the fence line, newline included
            continue
        if verbatim:
            continue
        if tok.type == tokenize.OP and tok.string == "[":
            depth += 1
        elif tok.type == tokenize.OP and tok.string == "]":
            if closing and closing[-1] == depth:
                closing.pop()
                edits.append((at(tok.start), at(tok.end), ""))
            depth -= 1
        last = _string_end(tokens, i)
        if last is not None:
            # Python 3.12+ tokenizes an f-string into parts (PEP 701), 3.11 as one STRING:
            # it is rewritten as one string on every version, so the twins do not depend on
            # the Python that generates them.
            resume = last + 1
            whole = text[at(tok.start) : at(tokens[last].end)]
            renamed = _renamed_string(whole)
            if renamed != whole:
                edits.append((at(tok.start), at(tokens[last].end), renamed))
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
        elif tok.string.startswith("async_"):  # a module: async_store -> sync_store
            edits.append((at(tok.start), at(tok.end), "sync_" + tok.string[6:]))
        elif tok.string.endswith("_async") and len(tok.string) > 6:  # open_async -> open
            edits.append((at(tok.start), at(tok.end), tok.string[:-6]))
    out = text
    for start, end, new in sorted(edits, reverse=True):
        out = out[:start] + new + out[end:]
    return out


_MARKER_IMPORT = re.compile(r"^from oncely\._twin import ASYNC\n", re.MULTILINE)


def _is_marker(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "ASYNC"


_VERBATIM_START = "# unasync: verbatim {"
_VERBATIM_END = "# unasync: verbatim }"


def unmark(text: str, *, fence: bool = False) -> str:
    """``text`` with every ``if ASYNC: A else: B`` replaced by ``B`` (dedented to the
    ``if``), or removed when it has no ``else``, and the marker's import dropped. With
    ``fence``, each kept ``B`` is fenced by comments that :func:`rewrite` leaves alone: it is
    sync code already."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    blocks: list[tuple[int, int, list[str]]] = []  # (first line, end line, replacement)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            found = getattr(node, field, None)
            for stmt in found if isinstance(found, list) else []:
                if not isinstance(stmt, ast.stmt) or not _is_marker(stmt):
                    continue
                assert isinstance(stmt, ast.If)
                if stmt.orelse and _is_marker(stmt.orelse[0]) and len(stmt.orelse) == 1:
                    raise SystemExit(f"unasync: line {stmt.lineno}: no elif after if ASYNC")
                indent = lines[stmt.lineno - 1][: stmt.col_offset]
                keep: list[str] = []
                if stmt.orelse:
                    first, last = stmt.orelse[0], stmt.orelse[-1]
                    start = _first_line(first) - 1
                    while start > 0 and lines[start - 1].strip() != "else:":
                        start -= 1  # comments between `else:` and its first statement
                    body = lines[start : (last.end_lineno or last.lineno)]
                    first_code = lines[_first_line(first) - 1]
                    inner = len(first_code) - len(first_code.lstrip())
                    keep = [indent + line[inner:] if line.strip() else line for line in body]
                    if fence:
                        keep = [f"{indent}{_VERBATIM_START}\n", *keep, f"{indent}{_VERBATIM_END}\n"]
                end = stmt.end_lineno or stmt.lineno
                blocks.append((stmt.lineno, end, keep))
    for first, end, keep in sorted(blocks, reverse=True):
        lines[first - 1 : end] = keep
    return _MARKER_IMPORT.sub("", "".join(lines))


def _first_line(node: ast.stmt) -> int:
    # A decorated definition starts at its first decorator.
    decorators = getattr(node, "decorator_list", None) or []
    return min([node.lineno, *(d.lineno for d in decorators)])


def _ruff() -> list[str]:
    exe = (
        shutil.which("ruff", path=str(Path(sys.executable).parent))
        or shutil.which("ruff", path=str(ROOT / ".venv" / "bin"))
        or shutil.which("ruff")
    )
    if exe is None:
        sys.exit("unasync: ruff is needed to format the generated code (pip install ruff)")
    return [exe]


def twin_of(source: Path) -> Path:
    return source.with_name("sync_" + source.name.removeprefix("async_"))


def generate(source: Path) -> str:
    source = source.resolve()
    relative = source.relative_to(ROOT).as_posix()
    header = (
        f"# Generated by tools/unasync.py from {relative}.\n"
        "# Do not edit: change the async source and run `make generate`.\n"
    )
    code = header + rewrite(unmark(source.read_text(encoding="utf-8"), fence=True))
    target = twin_of(source)
    fixed = subprocess.run(
        [*_ruff(), "check", "--fix-only", "--select", "I,F401", "--quiet",
         "--stdin-filename", str(target), "-"],
        input=code, capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    return subprocess.run(
        [*_ruff(), "format", "--quiet", "--stdin-filename", str(target), "-"],
        input=fixed, capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip


def sources(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("async_*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    package = PACKAGE
    stale: list[str] = []
    expected: set[Path] = set()
    for source in sources(package):
        target = twin_of(source)
        expected.add(target)
        code = generate(source)
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current == code:
            continue
        if args.check:
            stale.append(str(target.relative_to(package.parent)))
        else:
            target.write_text(code, encoding="utf-8")
            print(f"wrote {target.relative_to(package.parent)}")
    for orphan in package.rglob("sync_*.py"):
        if orphan not in expected:
            stale.append(f"{orphan.relative_to(package.parent)} (no async_ source beside it)")
    if stale:
        print("unasync: stale generated code (run `make generate`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
