"""Asynchronous checkpoint saves: stage a CPU copy, write it in the background, commit last.

Staging copies the state into private CPU memory and must finish before the next optimizer
step; writing (files, fsync, manifest, rename, pruning) reads only that copy and overlaps the
next steps, so the stall shrinks to the copy (benchmarks/checkpoint_stall.py). This is DCP's
`async_save` split into staging and upload, and torchtitan's `async_mode`. Both formats
implement `Writer`, the interface the trainer and resilience save through.

A thread, not a process: writes and hashing release the GIL. One save in flight: a new save
waits for the previous one (counted as stall), so at most one extra copy sits in host RAM.

A write that fails (a full or read-only volume, a writer that dies half-way) removes its
`step_N.tmp/` and is written once more from the same staged copy, so a passing fault costs
nothing; the retry runs where the first attempt did (in the background for async saves).
Either outcome is reported to `on_failure(step, error, committed)` at the next `save` or
`wait`: `committed` says whether the retry saved the checkpoint after all. The owner decides
what a lost checkpoint means (the trainer stops the run: hyperloom.resilience.guard).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from hyperloom.checkpoint.layout import CheckpointError, checkpoint_dir, describe_failure
from hyperloom.checkpoint.whole import save_checkpoint


class Writer(Protocol):
    """Saves checkpoints of one run directory, one at a time, maybe in the background.

    `save` returns the final `step_N/` path, committed only once `wait` has returned without
    error. A save that failed, then was retried once, is handed to
    `on_failure(step, error, committed)` at the next `save` or `wait`; without `on_failure`, a
    save the retry did not commit either is raised there as CheckpointError."""

    stall_s: list[float]  # time the training thread spent in each save
    last_committed: Path | None

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        train_state: dict[str, Any],
        extra_files: dict[str, str | bytes],
        meta: dict[str, Any],
        protect: frozenset[int] = frozenset(),
        after_first_file: Callable[[], None] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> Path: ...

    def wait(self) -> None: ...

    @property
    def in_flight(self) -> bool: ...


OnFailure = Callable[[int, BaseException, bool], None]


def stage(obj: Any, pin: bool = False) -> Any:
    """A deep copy of `obj` whose tensors are private CPU copies (the containers too)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone(memory_format=torch.contiguous_format)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out
    if isinstance(obj, dict):
        return {k: stage(v, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [stage(v, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(stage(v, pin) for v in obj)
    return obj


class CheckpointWriter:
    """The whole-format `Writer`: saves synchronously or in one background thread, with the
    same bytes."""

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        async_save: bool,
        on_failure: OnFailure | None = None,
    ) -> None:
        self.run_dir, self.keep, self.async_save = Path(run_dir), keep, async_save
        self.on_failure = on_failure
        self._thread: threading.Thread | None = None
        # (step, error, committed by the retry) of failed saves not yet reported
        self._failures: list[tuple[int, BaseException, bool]] = []
        self.stall_s: list[float] = []  # time the training thread spent in each save
        self.last_committed: Path | None = None

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        train_state: dict[str, Any],
        extra_files: dict[str, str | bytes],
        meta: dict[str, Any],
        protect: frozenset[int] = frozenset(),
        after_first_file: Callable[[], None] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> Path:
        """Stage the state and write it (now, or in the background). Returns the final path;
        in async mode it is committed only once `wait()` has returned without error."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        staged = stage((model_state, train_state), pin=torch.cuda.is_available())
        if synchronize is not None:
            synchronize()  # non-blocking device-to-host copies have landed
        args = (self.run_dir, step, *staged, extra_files, meta, self.keep, protect)
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write,
                args=(step, args, after_first_file),
                name=f"hyperloom-ckpt-{step}",
                daemon=True,
            )
            self._thread.start()
        else:
            self._write(step, args, after_first_file)
            self._raise_pending()
        self.stall_s.append(time.perf_counter() - start)
        return checkpoint_dir(self.run_dir, step)

    def _write(self, step: int, args: tuple, after_first_file) -> None:
        """Write the staged checkpoint; once more if that fails (the drill's fault, which
        strikes once, is left out of the retry)."""
        failed: BaseException | None = None
        for hook in (after_first_file, None):
            try:
                self.last_committed = save_checkpoint(*args, after_first_file=hook)
            except KeyboardInterrupt:
                raise  # a synchronous save interrupted by the user (save_checkpoint cleaned up)
            except BaseException as exc:  # noqa: BLE001 - reported to the training thread
                if failed is None:
                    failed = exc
                    continue
                self._failures.append((step, exc, False))
                return
            if failed is not None:
                self._failures.append((step, failed, True))
            return

    def wait(self) -> None:
        """Block until the in-flight save is committed (or failed, which is reported)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        failures, self._failures = self._failures, []
        for step, exc, committed in failures:
            if self.on_failure is not None:
                self.on_failure(step, exc, committed)
            elif not committed:
                raise CheckpointError(
                    f"checkpoint step {step} could not be written to "
                    f"{checkpoint_dir(self.run_dir, step).parent}: {describe_failure(exc)}"
                )

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
