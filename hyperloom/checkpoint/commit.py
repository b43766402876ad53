"""The commit protocol and integrity checks shared by both checkpoint formats.

A save writes into `step_N.tmp/` and fsyncs; `commit` writes the record `meta.json` (SHA-256
manifest) last, as PyTorch's DCP writes its `.metadata` last (its `filesystem.py`), renames
the directory into place and fsyncs the parent. A crash mid-save
never leaves a directory that looks finished; `latest_verified` loads the newest committed
checkpoint whose files match and says why it passed over newer ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hyperloom.checkpoint.layout import (
    STEP_RE,
    CheckpointError,
    checkpoint_dir,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    staging_dir,
)

log = logging.getLogger("hyperloom.checkpoint")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> str:
    """Write `data` durably (fsync) and return its SHA-256."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def write_files(directory: Path, files: dict[str, str | bytes]) -> dict[str, str]:
    """Write each file durably; returns name -> SHA-256."""
    return {
        name: _write(directory / name, content.encode() if isinstance(content, str) else content)
        for name, content in files.items()
    }


def hash_files(directory: Path, pattern: str = "*", skip=()) -> dict[str, str]:
    """SHA-256 of the files in `directory` matching `pattern`, except those named in `skip`,
    read back from disk: for files that DCP wrote (hyperloom.checkpoint.sharded)."""
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
    tmp, final = staging_dir(run_dir, step), checkpoint_dir(run_dir, step)
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
        if not STEP_RE.match(ckpt.name) or not (ckpt / "meta.json").is_file():
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
