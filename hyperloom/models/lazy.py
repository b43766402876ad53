"""Module attributes imported on first use (PEP 562).

Model families export their classes this way, so importing a family's accounting
(`hyperloom model info`, the planner) does not import torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `where[name]` (a module path) and returns its `name`."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
