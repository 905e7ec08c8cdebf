"""Import the user's code named on the command line as ``module:attribute``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from oncely.cli._errors import USAGE, CliError

__all__ = ["load_attribute"]


def load_attribute(spec: str, option: str) -> Any:
    """The object named by ``module:name`` (``package.module:object.method``), imported as
    ``python -m`` would (the working directory on the path). ``option`` names the flag in
    the errors (``--handler``)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CliError(f"{option} {spec!r}: write it as module:function", USAGE)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the project's own modules
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"{option} {spec!r}: cannot import {module_name!r} ({exc})", USAGE) from None
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise CliError(
                f"{option} {spec!r}: {module_name} has no {attribute!r}", USAGE
            ) from None
    return target
