"""A store published outside oncely, found by its entry point (``tests/plugins``): the whole
contract suite runs on it through ``oncely.open`` and ``oncely.open_async``, as a user's
third-party store would."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import oncely
from tests.backends import Backend, Scope

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.append(str(PLUGINS))  # as if `pip install oncely-shelf` had put it there
    importlib.invalidate_caches()


def _url(scope: Scope) -> str:
    return f"shelf://{scope.tmp_path / 'records.shelf'}"


BACKEND = Backend(
    name="shelf",
    make_sync=lambda scope, clock: oncely.open(_url(scope), clock=clock),
    make_async=lambda scope, clock: oncely.open_async(_url(scope), clock=clock),
)
