"""Saving and loading a training run: one home for both checkpoint formats.

`layout` (where checkpoints live; no torch), `commit` (the commit protocol, verification,
pruning), `whole` (whole tensors: safetensors + `train_state.pt`), `sharded` (DCP, every rank
writes its pieces, loading reshards), `state` (layout-free model and optimizer state), `rng`
(every random stream) and `writer` (the `Writer` interface, async saves). This module is the
interface the trainer, resilience, inference and the converters use; the sharded format's
modules are imported only when needed, so reading a whole checkpoint stays light.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperloom.checkpoint.commit import latest_verified, verify_checkpoint
from hyperloom.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    checkpoint_root,
    checkpoint_step,
    committed_steps,
    describe_failure,
    is_sharded,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    staging_dir,
)
from hyperloom.models.lazy import lazy_attributes

if TYPE_CHECKING:
    import torch

    from hyperloom.checkpoint.rng import restore_rng, rng_state
    from hyperloom.checkpoint.state import nonfinite_state
    from hyperloom.checkpoint.whole import load_train_state, load_weights, save_checkpoint
    from hyperloom.checkpoint.writer import CheckpointWriter, Writer
    from hyperloom.config import JobConfig, ModelConfig
    from hyperloom.parallel.layout import ParallelModel

# The modules that need torch load on first use: the CLI's converter and `config show`
# import this package without paying for torch.
__getattr__ = lazy_attributes(
    __name__,
    {
        "restore_rng": "hyperloom.checkpoint.rng",
        "rng_state": "hyperloom.checkpoint.rng",
        "load_train_state": "hyperloom.checkpoint.whole",
        "load_weights": "hyperloom.checkpoint.whole",
        "save_checkpoint": "hyperloom.checkpoint.whole",
        "nonfinite_state": "hyperloom.checkpoint.state",
        "CheckpointWriter": "hyperloom.checkpoint.writer",
        "Writer": "hyperloom.checkpoint.writer",
    },
)

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "Writer",
    "checkpoint_dir",
    "checkpoint_root",
    "checkpoint_step",
    "committed_steps",
    "describe_failure",
    "is_sharded",
    "latest_checkpoint",
    "latest_verified",
    "list_checkpoints",
    "load_initial_weights",
    "load_model_state",
    "load_state",
    "load_train_state",
    "load_weights",
    "nonfinite_state",
    "open_writer",
    "prepare_init_from",
    "resolve_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
    "staging_dir",
    "state_to_save",
    "verify_checkpoint",
]


def open_writer(
    fmt: str,
    run_dir: str | os.PathLike,
    keep: int,
    async_save: bool,
    on_failure: Callable[[int, BaseException, bool], None] | None = None,
) -> Writer:
    """The writer of checkpoint format `fmt` ("whole" or "sharded"; `checkpoint.format`).
    A sharded writer makes the process group of its saves: open it on every rank alike."""
    if fmt == "sharded":
        from hyperloom.checkpoint.sharded import ShardedCheckpointWriter

        return ShardedCheckpointWriter(Path(run_dir), keep, async_save, on_failure)
    from hyperloom.checkpoint.writer import CheckpointWriter

    return CheckpointWriter(Path(run_dir), keep, async_save, on_failure)


def load_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole weights, from either format (a sharded one is read in this process alone)."""
    if is_sharded(ckpt):
        from hyperloom.checkpoint.sharded import load_full

        return load_full(ckpt)[0]
    from hyperloom.checkpoint.whole import load_weights

    return load_weights(ckpt)


def load_initial_weights(
    pm: ParallelModel, path: str | os.PathLike, model: ModelConfig | None = None
) -> dict[str, Any]:
    """`checkpoint.init_from`: the weights a checkpoint shares with this model (same name
    and whole shape) into this rank's layout; the rest keep their init. A collective only in
    that every rank reads the file. Returns {checkpoint, loaded, kept_fresh, ignored} counts
    and the fresh names' top-level parts; CheckpointError if nothing fits or a shape differs.

    A Hugging Face directory ("hf:DIR", or a directory with config.json and safetensors) is
    converted in memory; `model`, the job's, must then be the architecture its config.json
    describes (or a vlm around that decoder), else CheckpointError lists the keys that differ."""
    from hyperloom.checkpoint.hf_read import hf_source
    from hyperloom.checkpoint.state import load_full_model_state

    hf_dir = hf_source(str(path))
    if hf_dir is not None:
        ckpt, saved = Path(f"hf:{hf_dir}"), _hf_initial_weights(hf_dir, model, str(path))
    else:
        ckpt = resolve_checkpoint(path)
        verify_checkpoint(ckpt)
        saved = load_model_state(ckpt)
    mine = {n for n, _ in pm.local_params()}
    try:
        loaded = load_full_model_state(pm, saved, partial=True)  # the names both hold
    except ValueError as exc:
        raise CheckpointError(f"checkpoint.init_from = {str(path)!r}: {exc}") from None
    if not pm.pipelined and not loaded:
        raise CheckpointError(
            f"checkpoint.init_from = {str(path)!r} shares no parameter name with this model "
            f"(it holds e.g. {', '.join(sorted(saved)[:3])}; this model "
            f"{', '.join(sorted(mine)[:3])})"
        )
    fresh = sorted(mine - set(loaded))
    return {
        "checkpoint": str(ckpt),
        "loaded": len(loaded),
        "kept_fresh": len(fresh),
        "fresh_parts": sorted({n.split(".")[0] for n in fresh}),
        "ignored": len(set(saved) - mine) if not pm.pipelined else None,
    }


def _open_hf_init(hf_dir: Path, model: ModelConfig | None, source: str):
    """(the directory, the model its config.json describes), the job's `model` checked to be
    that architecture (or a vlm around that decoder); CheckpointError listing what differs."""
    from hyperloom.checkpoint.hf_read import (
        ConvertError,
        architecture_differences,
        hf_job,
        open_hf_dir,
    )

    try:
        hf = open_hf_dir(hf_dir)
        theirs = hf_job(hf).model
    except ConvertError as exc:
        raise CheckpointError(f"checkpoint.init_from = {source!r}: {exc}") from None
    differ = architecture_differences(model, theirs, hf.values) if model else []
    if differ:
        more = f"; and {len(differ) - 8} more" if len(differ) > 8 else ""
        raise CheckpointError(
            f"checkpoint.init_from = {source!r}: the job's [model] is not the architecture of "
            f"{hf_dir / 'config.json'} ({'; '.join(differ[:8])}{more}); take it from there "
            f"with --model.preset hf:{hf_dir}"
        )
    return hf, theirs


def _hf_initial_weights(
    hf_dir: Path, model: ModelConfig | None, source: str
) -> dict[str, torch.Tensor]:
    """A Hugging Face directory's weights under hyperloom names (see `load_initial_weights`)."""
    from hyperloom.checkpoint.hf_read import ConvertError, load_hf_weights

    hf, theirs = _open_hf_init(hf_dir, model, source)
    try:
        return load_hf_weights(hf, theirs)
    except ConvertError as exc:
        raise CheckpointError(f"checkpoint.init_from = {source!r}: {exc}") from None


def prepare_init_from(cfg: JobConfig) -> JobConfig:
    """The job as a Hugging Face `checkpoint.init_from` shapes it, checked before any data is
    read: the directory must exist and describe the job's architecture, and an empty
    `data.tokenizer` becomes its tokenizer.json (a text family's run; with that tokenizer's
    eos token when the job's is not in it), so fine-tuning reads text as the model was trained
    to. Applies to a resumed run too, whose data must be the first run's. The data loader
    checks that the tokenizer fits model.vocab_size."""
    from hyperloom.checkpoint.hf_read import ConvertError, hf_source, hf_tokenizer

    source = cfg.checkpoint.init_from
    hf_dir = hf_source(source) if source else None
    if hf_dir is None:
        return cfg
    _open_hf_init(hf_dir, cfg.model, source)
    if cfg.data.tokenizer or cfg.model.family == "vlm":
        return cfg
    try:
        found = hf_tokenizer(hf_dir, cfg.data.eos_token)
    except ConvertError as exc:
        raise CheckpointError(f"checkpoint.init_from = {source!r}: {exc}") from None
    if found is None:
        return cfg
    data = dataclasses.replace(cfg.data, tokenizer=found[0], eos_token=found[1])
    return dataclasses.replace(cfg, data=data)


def state_to_save(pm: ParallelModel, opt, fmt: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(model state, optimizer state) to save in format `fmt` (a collective): the whole format
    gathers both whole; the sharded one puts this rank's model and optimizer pieces in DCP's
    state and leaves nothing for `train_state.pt` (None)."""
    if fmt == "sharded":
        from hyperloom.checkpoint.sharded import sharded_state

        return sharded_state(pm, opt), None
    from hyperloom.checkpoint.state import full_model_state, full_optimizer_state

    return full_model_state(pm), full_optimizer_state(pm, opt)


def load_state(pm: ParallelModel, opt, ckpt: Path, train_state: dict[str, Any]) -> None:
    """Load a checkpoint's model and optimizer state into this rank's layout, whatever
    layout wrote it (a collective); `train_state` is its `load_train_state`."""
    if is_sharded(ckpt):  # DCP reshards into this layout
        from hyperloom.checkpoint.sharded import load_sharded_state

        load_sharded_state(pm, opt, ckpt)
        return
    from hyperloom.checkpoint.state import load_full_model_state, load_full_optimizer_state
    from hyperloom.checkpoint.whole import load_weights

    load_full_model_state(pm, load_weights(ckpt))
    load_full_optimizer_state(pm, opt, train_state["optimizer"])
