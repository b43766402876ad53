"""Resilience events: one JSON line in metrics.jsonl and one readable line in events.log.

Events (anomaly, skip, rollback, give_up, checkpoint_fallback, checkpoint_failed, hang,
restart, ...) are rare and matter after the fact, so each is written and flushed at once, on
the main rank only. Until the trainer's Reporter exists (resuming happens before it is
created), JSON records are held back and handed to it when it is attached.

Both logs are appended to by runs that may be killed mid-write, so the last line can be torn.
`repair_tail` ends such a log at its last complete line before a resumed run appends to it,
and `read_jsonl` passes over a line that is not a JSON object instead of failing the resume.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperloom.resilience.lock import RunDirError

log = logging.getLogger("hyperloom.resilience")

EVENTS_LOG = "events.log"


class EventLog:
    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_LOG
        self.enabled = enabled
        self._sink: Callable[[dict[str, Any]], None] | None = None
        self._pending: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self._repaired = False

    def attach(self, sink: Callable[[dict[str, Any]], None] | None) -> None:
        """Send JSON records to `sink` (the Reporter) from now on, the held-back ones first."""
        self._sink = sink
        if sink is not None:
            for record in self._pending:
                sink(record)
            self._pending = []

    def emit(self, event: str, message: str, level: int = logging.WARNING, **fields: Any) -> None:
        """Record `event`; `message` is the sentence a person reads in events.log."""
        record = {"event": event, **fields, "time": round(time.time(), 3)}
        self.history.append(record)
        if not self.enabled:  # other ranks speak only of errors (a hang on their side)
            if level >= logging.ERROR:
                log.log(level, "%s: %s", event, message)
            return
        log.log(level, "%s: %s", event, message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        step = f" step {fields['step']}" if "step" in fields else ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self._repaired:
                self._repaired = True
                repair_tail(self.path)
            with self.path.open("a") as f:
                f.write(f"{stamp}{step} [{event}] {message}\n")
        except OSError as exc:  # a full or read-only run directory: one line, exit status 2
            raise RunDirError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        if self._sink is not None:
            self._sink(record)
        else:
            self._pending.append(record)


def read_events(run_dir: Path) -> list[str]:
    path = Path(run_dir) / EVENTS_LOG
    return path.read_text().splitlines() if path.is_file() else []


def json_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """Resilience records from metrics.jsonl (all, or those of one event)."""
    plain = {"train", "eval"}
    return [
        r
        for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
        if r.get("event") not in plain and event in (None, r.get("event"))
    ]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL log, one per line, in order ([] if there is no file). A
    line that is not one (torn by a crash mid-write) is passed over with a warning."""
    if not path.is_file():
        return []
    out, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            out.append(record)
        else:
            bad.append(n)
    if bad:
        log.warning(
            "%s: passed over %d line(s) that are not JSON records (line %s), torn by an "
            "interrupted write",
            path,
            len(bad),
            ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else ""),
        )
    return out


def repair_tail(path: Path) -> int:
    """Cut a torn last line (no newline at the end: the writer died mid-line) off an
    append-only log, so the next record starts on a line of its own; the complete lines
    before it are kept. Returns the bytes cut (0 for a sound or missing file)."""
    try:
        with path.open("rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            # Find the last newline, reading backwards in blocks.
            end, keep = size, 0
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                block = f.read(end - start)
                i = block.rfind(b"\n")
                if i >= 0:
                    keep = start + i + 1
                    break
                end = start
            f.truncate(keep)
    except FileNotFoundError:
        return 0
    log.warning(
        "%s: cut a torn last line (%d bytes, written when the run was interrupted)",
        path,
        size - keep,
    )
    return size - keep
