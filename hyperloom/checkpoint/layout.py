"""Where checkpoints live in a run directory, and which of them count.

A checkpoint is `RUN_DIR/checkpoints/step_00000300/` (while written, `step_00000300.tmp/`);
only a `step_N/` holding its commit record `meta.json` counts. Both formats share this layout;
a sharded one is told apart by DCP's `.metadata` (`is_sharded`). No torch is imported, so
finding a checkpoint costs only the file system.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d{8})$")
ENTRY_RE = re.compile(r"^step_\d{8}(\.tmp)?$")  # a checkpoint, or one being written


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the job."""


def describe_failure(exc: BaseException) -> str:
    """Why a save failed, in words: the file system's reason for an OSError ("No space left
    on device"), otherwise the exception's type and message."""
    if isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror
        if exc.errno == errno.EFBIG:
            reason += " (a file reached the size limit, ulimit -f)"
        return reason
    return f"{type(exc).__name__}: {exc}"


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


def discard_staging(run_dir: str | os.PathLike, step: int) -> None:
    """Remove what a failed save of `step` left in `step_N.tmp/` (best effort: the directory
    is never loaded, and the next save of `step` or a later commit removes it too)."""
    shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)


def readable_file(path: Path) -> bool:
    """`path` is a regular file; False, not an exception, when it cannot be looked at
    (a directory without read or search permission)."""
    try:
        return path.is_file()
    except OSError:
        return False


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def is_sharded(path: str | os.PathLike) -> bool:
    """A checkpoint directory written by DCP (the sharded format)."""
    return readable_file(Path(path) / ".metadata")


def checkpoint_entries(run_dir: str | os.PathLike) -> list[Path]:
    """Every directory under RUN_DIR/checkpoints/ named `step_N` or `step_N.tmp`, committed
    or not. An unreadable checkpoints directory is a CheckpointError: a run that cannot see
    its checkpoints must not start afresh over them."""
    root = checkpoint_root(run_dir)
    try:
        if not root.is_dir():
            return []
        return [p for p in root.iterdir() if ENTRY_RE.match(p.name) and p.is_dir()]
    except OSError as exc:
        raise CheckpointError(
            f"cannot read the checkpoints in {root}: {exc.strerror or exc}"
        ) from None


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (a `step_N/` whose commit record can be seen), oldest first."""
    found = [p for p in checkpoint_entries(run_dir) if STEP_RE.match(p.name)]
    return sorted(p for p in found if readable_file(p / "meta.json"))


def committed_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return [checkpoint_step(p) for p in list_checkpoints(run_dir)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    p = Path(path)
    try:
        os.listdir(p)
    except NotADirectoryError:
        raise CheckpointError(f"'{p}' is a file, not a checkpoint or run directory") from None
    except FileNotFoundError:
        pass  # said below
    except OSError as exc:
        raise CheckpointError(f"cannot read '{p}': {exc.strerror or exc}") from None
    weights = readable_file(p / "model.safetensors") or is_sharded(p)
    if readable_file(p / "meta.json") and weights:
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"'{p}' is neither a checkpoint directory (with meta.json and model.safetensors) "
            f"nor a run directory with a complete checkpoint under {checkpoint_root(p)}"
        )
    return latest
