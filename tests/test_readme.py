"""Every code block of the README runs as written, or is a file the tests run.

Python blocks run one after the other in one namespace, in a fresh directory (the tour builds on
itself). A block whose first line is ``# from examples/<file>`` is an excerpt: each of its lines
must appear in that file, in order, and that file is run by ``tests/test_examples.py``. Console
blocks name ``oncely`` subcommands that must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)


def _python_blocks() -> list[str]:
    return [code for lang, code in BLOCKS if lang == "python"]


def test_the_readme_python_blocks_run_in_order(tmp_path: Path) -> None:
    run = [code for code in _python_blocks() if not code.startswith("# from examples/")]
    assert len(run) >= 6
    _run_in_order(run, "README python", tmp_path)


def _run_in_order(blocks: list[str], label: str, where: Path) -> None:
    """``blocks`` run one after the other in one namespace, in the folder ``where``; the
    first that raises fails the test, named by ``label`` and its number."""
    namespace: dict[str, object] = {"__name__": "readme"}
    here = os.getcwd()
    os.chdir(where)
    try:
        for number, code in enumerate(blocks, 1):
            try:
                exec(compile(code, f"{label} block {number}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{label} block {number} fails: {exc!r}\n{code}")
    finally:
        os.chdir(here)


SECTIONS = ("HTTP endpoints", "Scheduled jobs", "ETL")
"""Sections a reader comes to straight from the contents, not through the tour: each one's
blocks run on their own, from their own imports."""


@pytest.mark.parametrize("title", SECTIONS)
def test_r19_a_readme_section_runs_on_its_own_as_written(tmp_path: Path, title: str) -> None:
    """Before, the HTTP, jobs and ETL sections used ``oncely``, ``asyncio`` and ``sqlite3``
    that only the tour at the top imports: copied on their own, they raised ``NameError``."""
    start = README.index(f"### {title}")
    after = re.search(r"^#{2,3} ", README[start + 4 :], re.M)
    end = start + 4 + after.start() if after else len(README)
    found = re.findall(r"```(\w+)\n(.*?)```", README[start:end], re.S)
    run = [code for lang, code in found if lang == "python" and not code.startswith("# from ")]
    assert run, title
    _run_in_order(run, f"{title} (on its own):", tmp_path)


def test_r19_each_testing_block_runs_on_its_own_as_written(tmp_path: Path) -> None:
    """A user copies one of the "Testing your own consumers" blocks into a test file: each
    must run alone, from its own imports. Before, the first used ``oncely`` and the second
    ``asyncio`` and ``oncely`` that only the tour imports (``NameError`` on their own)."""
    start = README.index("## Testing your own consumers")
    end = README.index("\n## ", start + 3)
    found = re.findall(r"```(\w+)\n(.*?)```", README[start:end], re.S)
    blocks = [code for lang, code in found if lang == "python"]
    assert len(blocks) >= 2
    for number, code in enumerate(blocks, 1):
        where = tmp_path / str(number)
        where.mkdir()
        _run_in_order([code], f"Testing your own consumers block {number} (alone):", where)


def test_the_readme_excerpts_are_in_the_examples_the_tests_run() -> None:
    excerpts = [code for code in _python_blocks() if code.startswith("# from examples/")]
    assert excerpts
    tested = (ROOT / "tests" / "test_examples.py").read_text()
    for code in excerpts:
        first, *lines = code.splitlines()
        name = first.removeprefix("# from ").split(",")[0].split()[0]
        assert Path(name).name in tested, f"{name} is not run by tests/test_examples.py"
        source = (ROOT / name).read_text().splitlines()
        at = 0
        for line in (line for line in lines if line.strip()):
            found = [i for i, text in enumerate(source[at:], at) if text.strip() == line.strip()]
            assert found, f"{line!r} is not in {name} (after line {at})"
            at = found[0] + 1


def test_the_oncely_commands_the_readme_shows_exist() -> None:
    commands = set()
    for lang, code in BLOCKS:
        if lang == "console":
            for line in code.splitlines():
                words = line.split()
                if words[:1] == ["oncely"] and len(words) > 1:
                    commands.add(tuple(w for w in words[1:3] if not w.startswith("-"))[:2])
    assert commands
    for command in sorted(commands):
        done = subprocess.run(
            [sys.executable, "-m", "oncely.cli", *command, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, (command, done.stderr)


POWERTOOLS = ROOT / "docs" / "coming-from-powertools.md"
POWERTOOLS_TABLE_URL = "dynamodb:///orders_inbox?region=eu-west-1"


def test_the_powertools_guide_is_linked_from_the_readme() -> None:
    assert "(docs/coming-from-powertools.md)" in README


def test_the_powertools_guide_lambda_blocks_run_on_dynamodb(tmp_path: Path) -> None:
    """The guide's Lambda handler, and the invocation that tries it, run as written on moto's
    DynamoDB, the table's URL pointed at a table of the test's own (the guide names AWS's)."""
    from tests.backends import dynamodb

    text = POWERTOOLS.read_text().split("## A Lambda function fed by SQS", 1)[1]
    blocks = [
        code for lang, code in re.findall(r"```(\w+)\n(.*?)```", text, re.S) if lang == "python"
    ]
    assert len(blocks) == 2 and POWERTOOLS_TABLE_URL in blocks[0]
    table = f"oncely_powertools_{os.getpid()}_{tmp_path.name}"[:60].replace("-", "_")
    url = f"dynamodb://{dynamodb.endpoint()}/{table}"
    try:
        _run_in_order(
            [blocks[0].replace(POWERTOOLS_TABLE_URL, url), blocks[1]], "powertools guide", tmp_path
        )
    finally:
        dynamodb.drop_table(table)
