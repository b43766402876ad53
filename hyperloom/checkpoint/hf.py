"""`hyperloom convert`: checkpoints to and from the Hugging Face format.

Export writes what `AutoModelForCausalLM.from_pretrained(DIR)` reads (`model.safetensors`,
`config.json`, the tokenizer); import turns such a directory into a committed hyperloom
checkpoint that `hyperloom generate` loads and that exports back bit for bit. Name maps and
config adapters live with each family (`models/<family>/hf.py`); reading a directory
(`hf_read`) is shared with the `hf:DIR` model preset and `checkpoint.init_from = "hf:DIR"`,
which convert in memory. Imports hold weights only, for inference, evaluation or fine-tuning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from hyperloom.checkpoint.hf_read import (
    ADAPTER_ERRORS,
    ConvertError,
    HFAdapter,
    adapters,
    error_reason,
    hf_job,
    hf_preset_values,
    load_hf_weights,
    open_hf_dir,
)
from hyperloom.config.model import register_preset_reader

__all__ = ["ConvertError", "HFAdapter", "add_convert_parser", "export_hf", "import_hf"]

log = logging.getLogger("hyperloom.convert")

# `model.preset = "hf:DIR"`: the architecture of a Hugging Face directory (config.json).
register_preset_reader("hf", hf_preset_values)


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write checkpoint (a run or checkpoint directory) as a Hugging Face model directory."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from hyperloom import checkpoint as ckpt
    from hyperloom.config import config_from_dict, read_toml

    ckpt_dir = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify_checkpoint(ckpt_dir)
    raw = read_toml(ckpt_dir / "config.toml")
    raw.pop("parallel", None)  # the layout that trained it does not matter here
    cfg = config_from_dict(raw, world_size=1).model
    adapter = adapters()[cfg.family]
    try:  # a model Hugging Face's class cannot hold is refused before anything is written
        hf_config = adapter.hf_config(cfg)
        hf_state = adapter.to_hf(ckpt.load_model_state(ckpt_dir), cfg)
    except ADAPTER_ERRORS as exc:
        raise ConvertError(f"{ckpt_dir}: {error_reason(exc)}") from None
    out = Path(out_dir)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    try:  # a full or read-only volume is a one-line error, not a traceback
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(str(out))
        if (ckpt_dir / "tokenizer.json").exists():
            shutil.copyfile(ckpt_dir / "tokenizer.json", out / "tokenizer.json")
    except (OSError, SafetensorError) as exc:
        reason = ckpt.describe_failure(exc) if isinstance(exc, OSError) else str(exc)
        raise ConvertError(f"cannot write {out}: {reason}") from None
    log.info("exported %s (%d tensors) to %s", ckpt_dir, len(tensors), out)
    return out


def _check_new_run_dir(run_dir: Path) -> None:
    """An import starts a run directory of its own: one that holds anything (a run with its
    checkpoints, metrics) is refused and left as it is, never pruned or overwritten."""
    if not (run_dir.exists() or run_dir.is_symlink()):
        return
    if not run_dir.is_dir():
        raise ConvertError(f"{run_dir} is not a directory; import into a new or empty one")
    try:
        used = any(run_dir.iterdir())
    except OSError as exc:
        raise ConvertError(f"cannot read {run_dir}: {exc.strerror or exc}") from None
    if used:
        raise ConvertError(
            f"{run_dir} is not empty (it may hold a run and its checkpoints, which an import "
            "would replace); import into a new or empty directory"
        )


def import_hf(hf_dir: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """Read a Hugging Face model directory into a hyperloom checkpoint under `run_dir`."""
    from hyperloom import checkpoint as ckpt
    from hyperloom.config import dumps_toml

    src = Path(hf_dir)
    _check_new_run_dir(Path(run_dir))
    hf = open_hf_dir(src)
    job = hf_job(hf)
    state = load_hf_weights(hf, job.model)
    model_type = hf.model_type
    files: dict[str, str | bytes] = {"config.toml": dumps_toml(job)}
    if (src / "tokenizer.json").exists():
        files["tokenizer.json"] = (src / "tokenizer.json").read_bytes()
    target, existed = Path(run_dir), Path(run_dir).exists()
    try:
        path = ckpt.save_checkpoint(
            run_dir,
            0,
            state,
            {"step": 0, "tokens_seen": 0, "imported_from": str(src)},
            files,
            {"imported_from_hf": model_type},
            keep=1,
        )
    except OSError as exc:  # a full or read-only volume: leave the target as it was
        shutil.rmtree(target if not existed else ckpt.checkpoint_root(target), ignore_errors=True)
        reason = ckpt.describe_failure(exc)
        raise ConvertError(f"cannot write the checkpoint into {target}: {reason}") from None
    log.info("imported %s (%d tensors) as %s", src, len(state), path)
    return path


def add_convert_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="checkpoints to and from the Hugging Face format")
    csub = p.add_subparsers(dest="direction", required=True)
    q = csub.add_parser("export", help="a hyperloom checkpoint -> a Hugging Face directory")
    q.add_argument("checkpoint", help="run directory or checkpoints/step_N directory")
    q.add_argument("out", help="output directory (model.safetensors, config.json, tokenizer)")
    q.set_defaults(func=cmd_convert)
    q = csub.add_parser("import", help="a Hugging Face directory -> a hyperloom checkpoint")
    q.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    q.add_argument("run_dir", help="a new or empty run directory for checkpoints/step_00000000")
    q.set_defaults(func=cmd_convert)


def cmd_convert(args: Any) -> int:
    if args.direction == "export":
        out = export_hf(args.checkpoint, args.out)
        config = json.loads((out / "config.json").read_text())
        loader = "AutoModelForCausalLM"
        if config.get("model_type") == "llava":  # no causal-LM mapping: an image-text model
            loader = "LlavaForConditionalGeneration"
        print(f"wrote {out} (load with transformers.{loader}.from_pretrained)")
    else:
        path = import_hf(args.hf_dir, args.run_dir)
        print(f"wrote {path} (try: hyperloom generate --checkpoint {args.run_dir})")
    return 0
