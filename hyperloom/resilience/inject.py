"""Fault injection for drills and tests: `resilience.inject = "kind@step[:rRANK],..."`.

Kinds, each firing once per run directory (a marker under RUN_DIR/drills/ remembers that it
fired, so a restarted or rolled-back run does not meet the same fault again):

- `nan_grad@k`: after the backward of step k, one gradient becomes NaN;
- `loss_spike@k`: step k's loss and gradients are multiplied by `SPIKE_FACTOR`;
- `crash@k`: the process dies (`os._exit`, like `kill -9`: no cleanup, no flush of an
  in-flight checkpoint) right after step k's update;
- `hang@k`: the process stops making progress after step k (the watchdog's job);
- `kill_during_save@k`: the process dies while the checkpoint of step k is half written;
- `disk_full@k`: writing the checkpoint of step k fails half-way with ENOSPC (the writer
  raises; training goes on);
- `writer_crash@k`: the background writer of step k's checkpoint dies half-way (it raises
  `WriterCrash` once part of the files is written: in the writer thread of the whole
  format, inside DCP's asynchronous write of the sharded one); the process and training go
  on. Needs `checkpoint.async_save = true`.

The save faults strike once the first file is on disk: the weights of the whole format, this
rank's shard files of the sharded one (before DCP's `.metadata`).

Without `:rN` the numeric faults hit every rank and the process faults hit rank 0. The
variable HYPERLOOM_INJECT adds specs to the config's, for drills on an existing config.
NVRx's `inject_fault.py` and Megatron's dist-checkpointing tests inject the same kinds of
faults (REFERENCE §5.4, §5.9). The spec grammar (`parse_inject`, `Fault`) lives with its
config section (hyperloom.config.resilience), so validating a job parses a spec without
importing this runtime.
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

SAVE_FAULTS = ("kill_during_save", "disk_full", "writer_crash")
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
        return None


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected by the disk_full drill)")


def _writer_crash() -> None:
    raise WriterCrash("the checkpoint writer died half-way (injected by the writer_crash drill)")


def die() -> None:
    """Leave now, like `kill -9`: no atexit handlers, no destructors, no flushed writers."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(CRASH_EXIT)
