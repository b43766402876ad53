"""`hyperloom convert`: checkpoints to and from the Hugging Face format.

Export writes what `AutoModelForCausalLM.from_pretrained(DIR)` reads (`model.safetensors`,
`config.json`, the tokenizer); import turns such a directory into a committed hyperloom
checkpoint that `hyperloom generate` loads and that exports back bit for bit. Name maps and
config adapters live with each family (`models/<family>/hf.py`). Imports hold weights only,
for inference and evaluation.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only in annotations: `hyperloom config` must not import it
    import torch

log = logging.getLogger("hyperloom.convert")


class ConvertError(ValueError):
    """A directory or checkpoint cannot be converted; the message says why."""


@dataclass(frozen=True)
class HFAdapter:
    """One family's Hugging Face mapping."""

    model_types: tuple[str, ...]  # the config.json "model_type" values it reads
    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    from_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    hf_config: Callable[[Any], Any]
    config_from_hf: Callable[[Any], dict[str, Any]]


def _adapters() -> dict[str, HFAdapter]:
    from hyperloom.models.deepseek import hf as ds
    from hyperloom.models.llama import hf as ll

    return {
        "llama": HFAdapter(
            ("llama", "qwen3"),  # qwen3: a Llama with qk-norm (model.qk_norm)
            lambda state, cfg: ll.to_hf_state_dict(state),
            ll.from_hf_state_dict,
            ll.hf_config,
            ll.config_from_hf,
        ),
        "deepseek": HFAdapter(
            ("deepseek_v3",),
            ds.to_hf_state_dict,
            ds.from_hf_state_dict,
            ds.hf_config,
            ds.config_from_hf,
        ),
    }


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write checkpoint (a run or checkpoint directory) as a Hugging Face model directory."""
    from safetensors.torch import save_file

    from hyperloom import checkpoint as ckpt
    from hyperloom.config import config_from_dict, read_toml

    ckpt_dir = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify_checkpoint(ckpt_dir)
    raw = read_toml(ckpt_dir / "config.toml")
    raw.pop("parallel", None)  # the layout that trained it does not matter here
    cfg = config_from_dict(raw, world_size=1).model
    adapter = _adapters()[cfg.family]
    hf_state = adapter.to_hf(ckpt.load_model_state(ckpt_dir), cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    adapter.hf_config(cfg).save_pretrained(str(out))
    if (ckpt_dir / "tokenizer.json").exists():
        shutil.copyfile(ckpt_dir / "tokenizer.json", out / "tokenizer.json")
    log.info("exported %s (%d tensors) to %s", ckpt_dir, len(tensors), out)
    return out


def _read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ConvertError(
            f"{hf_dir} has no model.safetensors (or model.safetensors.index.json); "
            f"only safetensors checkpoints are read"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(hf_dir / name)))
    return state


def import_hf(hf_dir: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """Read a Hugging Face model directory into a hyperloom checkpoint under `run_dir`."""
    from hyperloom import checkpoint as ckpt
    from hyperloom.config import ConfigError, DataConfig, config_from_dict, dumps_toml
    from hyperloom.models.registry import build_model

    src = Path(hf_dir)
    config_json = src / "config.json"
    if not config_json.is_file():
        raise ConvertError(f"{src} is not a Hugging Face model directory (no config.json)")
    hf_raw = json.loads(config_json.read_text())
    model_type = hf_raw.get("model_type")
    adapters = {t: a for a in _adapters().values() for t in a.model_types}
    if model_type not in adapters:
        raise ConvertError(
            f"{config_json}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(adapters))}"
        )
    from transformers import AutoConfig

    adapter = adapters[model_type]
    try:
        values = adapter.config_from_hf(AutoConfig.from_pretrained(str(src)))
    except ValueError as exc:
        raise ConvertError(f"{config_json}: {exc}") from None
    try:
        # The data section's default sequence must fit the imported model's positions.
        seq = min(DataConfig().seq_len, int(values["max_seq_len"]))
        job = config_from_dict({"model": values, "data": {"seq_len": seq}}, world_size=1)
    except ConfigError as exc:
        raise ConvertError(f"{config_json} maps to an invalid hyperloom model: {exc}") from None
    state = adapter.from_hf(_read_hf_weights(src), job.model)
    expected = {n: tuple(p.shape) for n, p in build_model(job.model).state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
        raise ConvertError(
            f"{src}: weights do not fit the model its config.json describes: missing "
            f"{missing[:4]}, unexpected {extra[:4]}, wrong shape {wrong[:4]}"
        )
    files: dict[str, str | bytes] = {"config.toml": dumps_toml(job)}
    if (src / "tokenizer.json").exists():
        files["tokenizer.json"] = (src / "tokenizer.json").read_bytes()
    path = ckpt.save_checkpoint(
        run_dir,
        0,
        state,
        {"step": 0, "tokens_seen": 0, "imported_from": str(src)},
        files,
        {"imported_from_hf": model_type},
        keep=1,
    )
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
    q.add_argument("run_dir", help="run directory to write checkpoints/step_00000000 into")
    q.set_defaults(func=cmd_convert)


def cmd_convert(args: Any) -> int:
    if args.direction == "export":
        out = export_hf(args.checkpoint, args.out)
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    else:
        path = import_hf(args.hf_dir, args.run_dir)
        print(f"wrote {path} (try: hyperloom generate --checkpoint {args.run_dir})")
    return 0
