"""Asynchronous checkpoint saves: stage a CPU copy, write it in the background, commit last.

Staging copies the state into private CPU memory and must finish before the next optimizer
step; writing (files, fsync, manifest, rename, pruning) reads only that copy and overlaps the
next steps, so the stall shrinks to the copy (benchmarks/checkpoint_stall.py). This is DCP's
`async_save` split into staging and upload, and torchtitan's `async_mode`. Both formats
implement `Writer`, the interface the trainer and resilience save through.

A thread, not a process: writes and hashing release the GIL. One save in flight: a new save
waits for the previous one (counted as stall), so at most one extra copy sits in host RAM. A
writer that raises is reported (`checkpoint_failed`) and the next save starts afresh; the
previous committed checkpoint stays the latest, as it does when the process is killed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from hyperloom.checkpoint.layout import CheckpointError, checkpoint_dir
from hyperloom.checkpoint.whole import save_checkpoint


class Writer(Protocol):
    """Saves checkpoints of one run directory, one at a time, maybe in the background.

    `save` returns the final `step_N/` path, committed only once `wait` has returned without
    error; a failed save is handed to `on_failure(step, exc)` (or raised as CheckpointError
    when there is none) at the next `save` or `wait`."""

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
        on_failure: Callable[[int, BaseException], None] | None = None,
    ) -> None:
        self.run_dir, self.keep, self.async_save = Path(run_dir), keep, async_save
        self.on_failure = on_failure
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
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
        try:
            self.last_committed = save_checkpoint(*args, after_first_file=after_first_file)
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread
            self._error = (step, exc)

    def wait(self) -> None:
        """Block until the in-flight save is committed (or failed, which is reported)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is None:
            return
        step, exc = self._error
        self._error = None
        if self.on_failure is not None:
            self.on_failure(step, exc)
        else:
            raise CheckpointError(f"saving the checkpoint of step {step} failed: {exc}")

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
