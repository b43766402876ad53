"""Resilience events: one JSON line in metrics.jsonl and one readable line in events.log.

Events (anomaly, skip, rollback, give_up, checkpoint_fallback, checkpoint_failed, hang,
restart, ...) are rare and matter after the fact, so each is written and flushed at once, on
the main rank only. Until the trainer's Reporter exists (resuming happens before it is
created), JSON records are held back and handed to it when it is attached.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("hyperloom.resilience")

EVENTS_LOG = "events.log"


class EventLog:
    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_LOG
        self.enabled = enabled
        self._sink: Callable[[dict[str, Any]], None] | None = None
        self._pending: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        step = f" step {fields['step']}" if "step" in fields else ""
        with self.path.open("a") as f:
            f.write(f"{stamp}{step} [{event}] {message}\n")
        if self._sink is not None:
            self._sink(record)
        else:
            self._pending.append(record)


def read_events(run_dir: Path) -> list[str]:
    path = Path(run_dir) / EVENTS_LOG
    return path.read_text().splitlines() if path.is_file() else []


def json_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """Resilience records from metrics.jsonl (all, or those of one event)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line]
    plain = {"train", "eval"}
    return [r for r in out if r["event"] not in plain and event in (None, r["event"])]
