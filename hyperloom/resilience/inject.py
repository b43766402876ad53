"""Fault injection for drills and tests: `resilience.inject = "kind@step[:rRANK],..."`.

Kinds: `nan_grad`, `loss_spike`, `crash` (`os._exit`, like `kill -9`), `hang`,
`kill_during_save`, `disk_full` (ENOSPC), `writer_crash` (the async writer raises half-way;
needs `checkpoint.async_save`), `stall_save` (the save stops for `STALL_S` seconds, a window
for a test to kill the process from outside). Each fires once per run directory (a marker
under RUN_DIR/drills/), so a restarted or rolled-back run does not meet it again; save faults
strike once the first file is on disk. Without `:rN` numeric faults hit every rank and
process faults rank 0; `HYPERLOOM_INJECT` adds specs. NVIDIA's Resiliency Extension
(`inject_fault.py`) and Megatron's dist-checkpointing tests inject the same kinds. The spec
grammar lives with its config section (hyperloom.config.resilience).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hyperloom.config import Fault, parse_inject

if TYPE_CHECKING:  # torch only in annotations: the drills' runtime needs no import of it
    import torch

log = logging.getLogger("hyperloom.resilience")

SAVE_FAULTS = ("kill_during_save", "disk_full", "writer_crash", "stall_save")
STALL_S = 120.0
SPIKE_FACTOR = 30.0
CRASH_EXIT = 43  # exit status of an injected crash (distinct from errors, 1, and usage, 2)


class WriterCrash(BaseException):
    """The checkpoint writer died half-way (the writer_crash drill). A BaseException, like
    the SystemExit that ends a thread: no `except Exception` on the way catches it, only the
    writer's own top level, which must then report the save as failed."""


class FaultInjector:
    """Fires the configured faults at their steps, each once per run directory."""

    def __init__(self, spec: str, run_dir: Path, rank: int) -> None:
        spec = ",".join(s for s in (spec, os.environ.get("HYPERLOOM_INJECT", "")) if s)
        self.faults = [f for f in parse_inject(spec) if f.hits(rank)]
        self.marks = run_dir / "drills"
        self.rank = rank

    def _take(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.step == step:
                mark = self.marks / f"fired.{f.name}.rank{self.rank}"
                if mark.exists():
                    return None
                self.marks.mkdir(parents=True, exist_ok=True)
                mark.write_text(f"{time.time()}\n")
                log.warning("drill: injecting %s on rank %d", f.name, self.rank)
                return f
        return None

    def grads(self, step: int, params: list[torch.nn.Parameter], loss: torch.Tensor) -> None:
        """After backward of `step`: poison or scale the gradients (and the reported loss)."""
        if not self.faults:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if self._take("nan_grad", step) and grads:
            g = grads[0]
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
        if self._take("loss_spike", step):
            loss.mul_(SPIKE_FACTOR)
            for g in grads:
                g.mul_(SPIKE_FACTOR)

    def after_step(self, step: int) -> None:
        """After the update of `step`: crash or hang here."""
        if self.faults and self._take("crash", step):
            die()
        if self.faults and self._take("hang", step):
            while True:  # only the watchdog (or a signal) ends this
                time.sleep(3600)

    def save_fault(self, step: int) -> Callable[[], None] | None:
        """What to do once the first file of step `step`'s checkpoint is written, if anything."""
        if self.faults and self._take("kill_during_save", step):
            return die
        if self.faults and self._take("disk_full", step):
            return _disk_full
        if self.faults and self._take("writer_crash", step):
            return _writer_crash
        if self.faults and self._take("stall_save", step):
            return _stall
        return None


def _stall() -> None:
    log.warning("drill: the save stalls for %.0f s", STALL_S)
    time.sleep(STALL_S)


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected by the disk_full drill)")


def _writer_crash() -> None:
    raise WriterCrash("the checkpoint writer died half-way (injected by the writer_crash drill)")


def die() -> None:
    """Leave now, like `kill -9`: no atexit handlers, no destructors, no flushed writers."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(CRASH_EXIT)
