"""Hangs and restart loops: a progress watchdog and a guard against restarting in vain.

A rank that stops progressing blocks the job without failing it, and torchrun restarts only on
exit. So a daemon thread watches the time since the last step; after `timeout_s` it dumps every
thread's stack to `RUN_DIR/hang_rank{R}.txt` and exits with `HANG_EXIT`, and the group is
restarted from the newest committed checkpoint: NVIDIA Resiliency Extension's in-job restart
(`ft_launcher`) reduced to one host and a fixed timeout. `heartbeat()` also marks slow
legitimate phases (compilation, validation, synchronous saves).

The restart guard records each restart's resume step in `RUN_DIR/restarts.json`; after `limit`
restarts in a row from the same step it gives up (NVRx stops after 3 without progress), every
rank exiting successfully so torchrun stops too, and `hyperloom train` exits `GAVE_UP_EXIT`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hyperloom.resilience")

HANG_EXIT = 44  # a rank's exit status when the watchdog ended it
GAVE_UP_EXIT = 3  # `hyperloom train`'s exit status when the restart guard gave up
RESTARTS_FILE = "restarts.json"


class RestartLoopError(RuntimeError):
    """The restart guard saw too many restarts without progress (the message says why)."""


class Watchdog:
    """Ends the process when `heartbeat()` has not been called for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, on_fire=None) -> None:
        self.timeout_s, self.run_dir, self.rank = timeout_s, Path(run_dir), rank
        self.on_fire = on_fire  # called with the stack file before exiting (an event)
        self._last = time.monotonic()
        self._step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self.heartbeat()
        self._thread = threading.Thread(target=self._watch, name="hyperloom-watchdog", daemon=True)
        self._thread.start()

    def heartbeat(self, step: int | None = None) -> None:
        self._last = time.monotonic()
        if step is not None:
            self._step = step

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self.fire(idle)

    def fire(self, idle: float) -> None:
        """Dump every thread's stack to the run dir and exit with HANG_EXIT."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / f"hang_rank{self.rank}.txt"
        with path.open("w") as f:
            f.write(
                f"no progress for {idle:.1f} s (watchdog timeout {self.timeout_s:g} s) after "
                f"step {self._step}; stacks of all threads:\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        log.error(
            "watchdog: no progress for %.1f s after step %s on rank %d; stacks in %s; exiting "
            "with status %d so that the group is restarted",
            idle,
            self._step,
            self.rank,
            path,
            HANG_EXIT,
        )
        if self.on_fire is not None:
            try:
                self.on_fire(self._step, idle, path)
            except Exception:  # noqa: BLE001 - the exit matters more than the event
                pass
        logging.shutdown()
        sys.stderr.flush()
        os._exit(HANG_EXIT)


def restart_count() -> int:
    """How many times this worker group was restarted: by `hyperloom train --max-restarts`
    (HYPERLOOM_RESTART_COUNT) and/or by torchrun's own restarts; 0 on a first launch."""
    ours = int(os.environ.get("HYPERLOOM_RESTART_COUNT", "0"))
    return ours + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_start(run_dir: Path, resumed_step: int, limit: int) -> dict[str, Any]:
    """Note this start in RUN_DIR/restarts.json (main rank only) and return the record; its
    "gave_up" field is the reason to stop, or None."""
    path = Path(run_dir) / RESTARTS_FILE
    restart = restart_count()
    state: dict[str, Any] = {"starts": [], "stalled": 0, "gave_up": None}
    if restart > 0:  # a fresh launch starts a fresh count
        state = _read_state(path) or state
    previous = state["starts"][-1]["step"] if state["starts"] else None
    state["stalled"] = state["stalled"] + 1 if restart > 0 and previous == resumed_step else 0
    state["starts"].append({"restart": restart, "step": resumed_step, "time": time.time()})
    state["gave_up"] = None
    if limit and state["stalled"] >= limit:
        state["gave_up"] = (
            f"{state['stalled']} restarts in a row resumed from step {resumed_step} without "
            f"getting further (resilience.max_stalled_restarts = {limit}); the fault comes "
            f"back every time: see events.log and hang_rank*.txt in {run_dir}"
        )
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # replaced whole: a kill mid-write tears nothing
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)
    return state


def _read_state(path: Path) -> dict[str, Any] | None:
    """restarts.json, or None if it is missing or not the guard's record (written by an
    older version non-atomically and torn, say): the count then starts afresh."""
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); the restart count starts afresh", path, exc)
        return None
    ok = isinstance(state, dict) and isinstance(state.get("starts"), list)
    ok = ok and isinstance(state.get("stalled"), int)
    if not ok:
        log.warning("%s is not a restart record; the restart count starts afresh", path)
        return None
    return state


def gave_up_reason(run_dir: Path) -> str | None:
    """The restart guard's reason if the last start in `run_dir` gave up."""
    state = _read_state(Path(run_dir) / RESTARTS_FILE)
    reason = state.get("gave_up") if state else None
    return reason if isinstance(reason, str) else None
