"""Progress bars for long data work, drawn on the console the log lines go to.

The CLI logs through a `rich.logging.RichHandler`; a bar drawn on that handler's console shares
the screen region with the log lines instead of overwriting them (the trainer's progress bar
uses the same console: `hyperloom.train.report`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def logging_console() -> Console:
    """The console of the root logger's RichHandler, else a new one on stderr."""
    from rich.logging import RichHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, RichHandler):
            return handler.console
    return Console(stderr=True)


@contextlib.contextmanager
def byte_progress(what: str, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bar for `total` bytes of work; yields advance(n) for n more bytes done (a no-op when
    not `enabled`, as on every rank but the main one)."""
    if not enabled:
        yield lambda n: None
        return
    columns = (
        TextColumn(f"[bold]{what}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=logging_console()) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)
