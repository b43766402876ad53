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
import shutil
from pathlib import Path
from typing import Any

from hyperloom.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    checkpoint_entries,
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
    fsync the parent, then prune older checkpoints to leave `keep` with this one (sparing
    the steps in `protect`)."""
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
    # Pruning counts back from this checkpoint: it and the `keep - 1` before it stay. Newer
    # ones (a run resumed from an older checkpoint) are another timeline's, never this
    # save's to delete, and this save is never pruned because they exist.
    older = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) < step]
    for old in older[: max(0, len(older) - (keep - 1))]:
        if checkpoint_step(old) not in protect:
            shutil.rmtree(old, ignore_errors=True)
    for dead in root.glob("step_*.tmp"):  # saves of earlier steps that never finished
        if dead.name[:13] < final.name:
            shutil.rmtree(dead, ignore_errors=True)
    return final


# Files a commit record's manifest must name: the weights of either format and the state.
WEIGHT_FILES = ("model.safetensors", ".metadata")
TRAIN_STATE = "train_state.pt"
LOADED = (*WEIGHT_FILES, TRAIN_STATE)  # with DCP's *.distcp shards: what a load reads


def read_meta(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's commit record, checked for shape: a JSON object whose `sha256` maps each
    file name to its hex digest and names the weights and `train_state.pt`. Anything else
    (unreadable, not JSON, another JSON type, no manifest) is a CheckpointError that names
    `ckpt`: a record that vouches for nothing must not let its files be loaded."""
    try:
        raw = (ckpt / "meta.json").read_bytes()
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {ckpt}: cannot read meta.json: {exc.strerror or exc}"
        ) from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise CheckpointError(f"checkpoint {ckpt}: meta.json is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint {ckpt}: meta.json holds a JSON {type(meta).__name__}, not the commit "
            f"record (an object)"
        )
    manifest = meta.get("sha256")
    if not isinstance(manifest, dict) or not manifest:
        raise CheckpointError(f"checkpoint {ckpt}: meta.json has no SHA-256 manifest")
    for name, digest in manifest.items():
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or "/" in name
            or "\\" in name
            or name in ("", ".", "..", "meta.json")
        ):
            raise CheckpointError(
                f"checkpoint {ckpt}: meta.json's SHA-256 manifest has a bad entry {name!r}"
            )
    if TRAIN_STATE not in manifest or not any(w in manifest for w in WEIGHT_FILES):
        raise CheckpointError(
            f"checkpoint {ckpt}: meta.json's SHA-256 manifest does not cover the weights and "
            f"{TRAIN_STATE} (it names {sorted(manifest)})"
        )
    return meta


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check every file against the SHA-256 manifest in meta.json (`read_meta`); return the
    meta. Every failure, unreadable files included, is a CheckpointError naming `ckpt`."""
    meta = read_meta(ckpt)
    try:  # every file a load reads is vouched for, not only those the record names
        loaded = [f.name for f in ckpt.iterdir() if f.name in LOADED or f.suffix == ".distcp"]
    except OSError as exc:
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {exc.strerror or exc}") from None
    unlisted = sorted(set(loaded) - set(meta["sha256"]))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {ckpt}: {', '.join(unlisted)} not covered by meta.json's SHA-256 manifest"
        )
    for name, digest in meta["sha256"].items():
        f = ckpt / name
        try:
            if not f.is_file():
                raise CheckpointError(f"checkpoint {ckpt} is missing {name}")
            ok = _sha256(f) == digest
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {ckpt}: cannot read {name}: {exc.strerror or exc}"
            ) from None
        if not ok:
            raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its SHA-256")
    return meta


def latest_verified(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint whose files match their SHA-256, and a sentence for
    each newer directory that was passed over (uncommitted, unreadable or corrupted), each
    naming that directory."""
    rejected = []
    found = checkpoint_entries(run_dir)
    for ckpt in sorted(found, key=lambda p: (p.name[:13], p.name), reverse=True):
        if ckpt.name.endswith(".tmp"):
            rejected.append(f"{ckpt.name} is not committed (no meta.json): an interrupted save")
            continue
        try:
            os.listdir(ckpt)
            committed = (ckpt / "meta.json").exists()
        except OSError as exc:  # no read or search permission
            rejected.append(f"{ckpt.name} cannot be read ({exc.strerror or exc})")
            continue
        if not committed:
            # A step_N/ was renamed into place with its meta.json: the record was lost since.
            rejected.append(
                f"{ckpt.name} is not committed (no meta.json): its commit record is gone"
            )
            continue
        try:
            verify_checkpoint(ckpt)
            return ckpt, rejected
        except CheckpointError as exc:
            rejected.append(str(exc))
    return None, rejected
