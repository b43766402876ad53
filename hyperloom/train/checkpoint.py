"""Single-process checkpoints: atomic, self-describing, resumable bit for bit.

A checkpoint is a directory `RUN_DIR/checkpoints/step_00000300/` holding

- `model.safetensors`: the FP32 weights, Hugging-Face-style safetensors (readable by others);
- `train_state.pt`: optimizer state, step, data-loader position, every RNG stream;
- `config.toml`: the resolved job config; `tokenizer.json`: the tokenizer;
- `meta.json`: step, tokens seen, last loss, and SHA-256 of each file above.

It is written into `step_….tmp/` and renamed into place only when complete, so a crash
mid-save never leaves a directory that looks finished; `latest_checkpoint` ignores anything
else. `meta.json` is the commit record, like DCP's `.metadata` (REFERENCE §5.1): it is
written last, after every other file has been written and fsynced, and it carries the SHA-256
manifest of those files; the directory rename then publishes the whole, and the parent
directory is fsynced so the rename survives a power cut. A directory without `meta.json`, or
whose files do not match it, is never loaded: `latest_verified` falls back to the newest
checkpoint that is committed and verifies (hyperloom.resilience.checkpoint adds the
asynchronous writer on top).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save

log = logging.getLogger("hyperloom.checkpoint")

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the job."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state(device_rng: torch.Tensor | None) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": device_rng,
    }


def restore_rng(state: dict[str, Any]) -> torch.Tensor | None:
    """Restore host RNGs; returns the device RNG state for the accelerator to set."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    return state.get("device")


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that also feeds what is written to a SHA-256."""

    def __init__(self, f) -> None:
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write(path: Path, data: bytes) -> str:
    """Write `data` durably (fsync) and return its SHA-256."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


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
    """
    tmp = fresh_staging_dir(run_dir, step)
    # safetensors wants contiguous tensors that do not share storage (the caller's copies:
    # hyperloom.resilience.checkpoint.stage). Each file is hashed as it is written and
    # fsynced, rather than read back for its SHA-256 afterwards.
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    hashes = {"model.safetensors": _write(tmp / "model.safetensors", save(tensors))}
    if after_first_file is not None:
        after_first_file()
    with (tmp / "train_state.pt").open("wb") as f:
        hashing = _HashingWriter(f)
        torch.save(train_state, hashing)
        f.flush()
        os.fsync(f.fileno())
    hashes["train_state.pt"] = hashing.sha256.hexdigest()
    hashes.update(write_files(tmp, extra_files))
    return commit(run_dir, step, hashes, meta, keep, protect)


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` is written before its commit: `step_N.tmp/`."""
    return checkpoint_root(run_dir) / f"step_{step:08d}.tmp"


def fresh_staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """An empty `step_N.tmp/` (what an earlier, interrupted save of `step` left is removed)."""
    tmp = staging_dir(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_files(directory: Path, files: dict[str, str | bytes]) -> dict[str, str]:
    """Write each file durably; returns name -> SHA-256."""
    return {
        name: _write(directory / name, content.encode() if isinstance(content, str) else content)
        for name, content in files.items()
    }


def hash_files(directory: Path, pattern: str = "*", skip=()) -> dict[str, str]:
    """SHA-256 of the files in `directory` matching `pattern`, except those named in `skip`,
    read back from disk: for files that DCP wrote (hyperloom.resilience.sharded)."""
    return {
        f.name: _sha256(f)
        for f in sorted(directory.glob(pattern))
        if f.is_file() and f.name not in skip
    }


def commit(
    run_dir: str | os.PathLike,
    step: int,
    hashes: dict[str, str],
    meta: dict[str, Any],
    keep: int,
    protect: frozenset[int] = frozenset(),
) -> Path:
    """Publish `step_N.tmp/`, whose files are all written and fsynced: write the commit
    record `meta.json` (with the SHA-256 manifest) last, rename the directory into place,
    fsync the parent, then prune to the newest `keep` (sparing the steps in `protect`)."""
    root = checkpoint_root(run_dir)
    tmp, final = staging_dir(run_dir, step), root / f"step_{step:08d}"
    hashes = dict(sorted(hashes.items()))
    # The commit record, written last: without it the directory is not a checkpoint.
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "sha256": hashes}, indent=2))
    _fsync(tmp / "meta.json")
    if final.exists():  # re-saving the same step (e.g. after a rollback) replaces it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    log.info("saved checkpoint %s", final)
    committed = list_checkpoints(run_dir)
    for old in committed[:-keep]:
        if checkpoint_step(old) not in protect:
            shutil.rmtree(old, ignore_errors=True)
    for dead in root.glob("step_*.tmp"):  # saves of earlier steps that never finished
        if dead.name[:13] < final.name:
            shutil.rmtree(dead, ignore_errors=True)
    return final


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(p for p in found if (p / "meta.json").is_file())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    p = Path(path)
    weights = (p / "model.safetensors").is_file() or (p / ".metadata").is_file()  # or sharded
    if (p / "meta.json").is_file() and weights:
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"'{p}' is neither a checkpoint directory (with meta.json and model.safetensors) "
            f"nor a run directory with a complete checkpoint under {checkpoint_root(p)}"
        )
    return latest


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check every file against the SHA-256 in meta.json; return the meta."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for name, digest in meta.get("sha256", {}).items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is missing {name}")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its SHA-256")
    return meta


def latest_verified(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint whose files match their SHA-256, and a sentence for
    each newer directory that was passed over (uncommitted or corrupted)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None, []
    found = [p for p in root.iterdir() if p.is_dir() and re.match(r"^step_\d{8}", p.name)]
    rejected = []
    for ckpt in sorted(found, key=lambda p: (p.name[:13], p.name), reverse=True):
        if not _STEP_RE.match(ckpt.name) or not (ckpt / "meta.json").is_file():
            # A step_N/ was renamed into place with its meta.json: the record was lost since.
            tmp = ckpt.name.endswith(".tmp")
            how = "an interrupted save" if tmp else "its commit record is gone"
            rejected.append(f"{ckpt.name} is not committed (no meta.json): {how}")
            continue
        try:
            verify_checkpoint(ckpt)
            return ckpt, rejected
        except (CheckpointError, ValueError, OSError) as exc:
            rejected.append(str(exc))
    return None, rejected


def load_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole weights, from either format (a sharded one is read in this process alone)."""
    if (ckpt / ".metadata").is_file():
        from hyperloom.resilience.sharded import load_full

        return load_full(ckpt)[0]
    return load_file(str(ckpt / "model.safetensors"))


def load_train_state(ckpt: Path) -> dict[str, Any]:
    # Our own file with numpy RNG state inside, hence weights_only=False; integrity was
    # checked against meta.json first.
    return torch.load(ckpt / "train_state.pt", weights_only=False)
