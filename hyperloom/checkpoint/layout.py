"""Where checkpoints live in a run directory, and which of them count.

A checkpoint is `RUN_DIR/checkpoints/step_00000300/` (while written, `step_00000300.tmp/`);
only a `step_N/` holding its commit record `meta.json` counts. Both formats share this layout;
a sharded one is told apart by DCP's `.metadata` (`is_sharded`). No torch is imported, so
finding a checkpoint costs only the file system.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the job."""


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the committed checkpoint of `step` is (or will be): `step_N/`."""
    return checkpoint_root(run_dir) / f"step_{step:08d}"


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


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def is_sharded(path: str | os.PathLike) -> bool:
    """A checkpoint directory written by DCP (the sharded format)."""
    return (Path(path) / ".metadata").is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name)]
    return sorted(p for p in found if (p / "meta.json").is_file())


def committed_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return [checkpoint_step(p) for p in list_checkpoints(run_dir)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    p = Path(path)
    weights = (p / "model.safetensors").is_file() or is_sharded(p)
    if (p / "meta.json").is_file() and weights:
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"'{p}' is neither a checkpoint directory (with meta.json and model.safetensors) "
            f"nor a run directory with a complete checkpoint under {checkpoint_root(p)}"
        )
    return latest
