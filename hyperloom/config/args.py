"""Value types for the command lines' own flags (`hyperloom plan`, `schedule`, `drill`):
finite numbers in a range, refused by argparse in one line that says what is allowed."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type = float, least: float | None = None, above: float | None = None
) -> Callable[[str], float | int]:
    """An argparse `type`: a finite `kind` (int or float), >= `least` and > `above`."""
    bounds = [
        f">= {least:g}" if least is not None else "",
        f"> {above:g}" if above is not None else "",
    ]
    allowed = " and ".join(b for b in bounds if b)
    what = f"a finite {'whole ' if kind is int else ''}number" + (f" {allowed}" if allowed else "")

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        ok = math.isfinite(value) and (least is None or value >= least)
        if not ok or (above is not None and value <= above):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse
