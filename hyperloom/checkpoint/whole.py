"""The whole-tensor checkpoint format: atomic, self-describing, resumable bit for bit.

`step_N/` holds `model.safetensors` (FP32 weights), `train_state.pt` (optimizer, step, data
position, RNG streams), `config.toml`, `tokenizer.json` and `meta.json` (SHA-256 of each).
Tensors are whole and keyed by name (`state`), so it loads into any layout; the main rank
writes it through the commit protocol. The sharded format keeps the small files and replaces
the weights.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from hyperloom.checkpoint.commit import commit, write_files
from hyperloom.checkpoint.layout import discard_staging, fresh_staging_dir

WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"


class _HashingWriter:
    """A binary file that also feeds what is written to a SHA-256, and keeps the OSError of a
    failed write: torch.save reports that only as "[enforce fail at inline_container.cc]
    unexpected pos", which tells a user nothing."""

    def __init__(self, f) -> None:
        self.f, self.sha256 = f, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as exc:
            self.error = exc
            raise


def _torch_save(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path` durably; returns its SHA-256. A failed write raises the
    file system's OSError (e.g. No space left on device), not torch's translation of it."""
    with path.open("wb") as f:
        hashing = _HashingWriter(f)
        try:
            torch.save(obj, hashing)
        except RuntimeError:
            if hashing.error is not None:
                raise hashing.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return hashing.sha256.hexdigest()


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    extra_files: dict[str, str | bytes],
    meta: dict[str, Any],
    keep: int,
    protect: frozenset[int] = frozenset(),
    after_first_file: Callable[[], None] | None = None,
) -> Path:
    """Write a complete checkpoint atomically and prune to the newest `keep`.

    Checkpoints at the steps in `protect` (the last stable one) survive pruning.
    `after_first_file` runs once the weights are on disk (a drill kills the process there).
    A save that raises removes its `step_N.tmp/` before the exception goes on.
    """
    try:
        tmp = fresh_staging_dir(run_dir, step)
        # safetensors wants contiguous tensors that do not share storage (the caller's
        # copies: hyperloom.checkpoint.writer.stage). Each file is hashed as it is written and
        # fsynced, rather than read back for its SHA-256 afterwards.
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        hashes = write_files(tmp, {WEIGHTS: save(tensors)})
        if after_first_file is not None:
            after_first_file()
        hashes[TRAIN_STATE] = _torch_save(train_state, tmp / TRAIN_STATE)
        hashes.update(write_files(tmp, extra_files))
        return commit(run_dir, step, hashes, meta, keep, protect)
    except BaseException:
        discard_staging(run_dir, step)  # nothing half-written stays behind
        raise


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The weights of a whole-format checkpoint."""
    return load_file(str(ckpt / WEIGHTS))


def load_train_state(ckpt: Path) -> dict[str, Any]:
    """`train_state.pt` (both formats): optimizer state of the whole format, step, loader
    position, RNG streams, FP8 scaling and resilience state."""
    # Our own file with numpy RNG state inside, hence weights_only=False; integrity was
    # checked against meta.json first.
    return torch.load(ckpt / TRAIN_STATE, weights_only=False)
