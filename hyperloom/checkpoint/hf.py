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
from dataclasses import dataclass, field
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
    # The [data] values an imported run's config needs beyond the defaults (a vlm: images).
    import_data: dict[str, Any] = field(default_factory=dict)


def _adapters() -> dict[str, HFAdapter]:
    from hyperloom.models.deepseek import hf as ds
    from hyperloom.models.llama import hf as ll
    from hyperloom.models.vlm import hf as vl

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
        "vlm": HFAdapter(
            ("llava",),  # LlavaForConditionalGeneration: CLIP or SigLIP tower, llama/deepseek
            vl.to_hf_state_dict,
            vl.from_hf_state_dict,
            vl.hf_config,
            vl.config_from_hf,
            import_data={"source": "scenes"},  # a vlm's config needs an image source
        ),
    }


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
    adapter = _adapters()[cfg.family]
    try:  # a model Hugging Face's class cannot hold is refused before anything is written
        hf_state = adapter.to_hf(ckpt.load_model_state(ckpt_dir), cfg)
    except ValueError as exc:
        raise ConvertError(f"{ckpt_dir}: {exc}") from None
    out = Path(out_dir)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    try:  # a full or read-only volume is a one-line error, not a traceback
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        adapter.hf_config(cfg).save_pretrained(str(out))
        if (ckpt_dir / "tokenizer.json").exists():
            shutil.copyfile(ckpt_dir / "tokenizer.json", out / "tokenizer.json")
    except (OSError, SafetensorError) as exc:
        reason = ckpt.describe_failure(exc) if isinstance(exc, OSError) else str(exc)
        raise ConvertError(f"cannot write {out}: {reason}") from None
    log.info("exported %s (%d tensors) to %s", ckpt_dir, len(tensors), out)
    return out


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; ConvertError naming the file for anything else."""
    try:
        raw = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConvertError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ConvertError(f"{path} is not valid JSON ({exc}); expected {what}") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{path} holds a JSON {type(raw).__name__}; expected {what}")
    return raw


def _read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "an object with a weight_map").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ConvertError(f"{index} has no weight_map of tensor names to file names")
        files = sorted(set(weight_map.values()))
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ConvertError(
            f"{hf_dir} has no model.safetensors (or model.safetensors.index.json); "
            f"only safetensors checkpoints are read"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(hf_dir / name)))
        except (OSError, SafetensorError) as exc:
            raise ConvertError(
                f"{hf_dir / name} is not a readable safetensors file: {exc}"
            ) from None
    return state


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
    from hyperloom.config import ConfigError, DataConfig, config_from_dict, dumps_toml
    from hyperloom.models.registry import build_model

    src = Path(hf_dir)
    _check_new_run_dir(Path(run_dir))
    config_json = src / "config.json"
    if not config_json.is_file():
        raise ConvertError(f"{src} is not a Hugging Face model directory (no config.json)")
    hf_raw = _read_json(config_json, "a Hugging Face model config (an object)")
    model_type = hf_raw.get("model_type")
    adapters = {t: a for a in _adapters().values() for t in a.model_types}
    if not isinstance(model_type, str) or model_type not in adapters:
        raise ConvertError(
            f"{config_json}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(adapters))}"
        )
    from transformers import AutoConfig

    adapter = adapters[model_type]
    for key in ("attention_bias", "mlp_bias"):
        if hf_raw.get(key):
            raise ConvertError(f"{config_json}: {key} = true: this model's linears have no bias")
    try:
        hf_config = AutoConfig.from_pretrained(str(src))
    except Exception as exc:  # transformers' checks raise ValueError, TypeError, its own kinds
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise ConvertError(f"{config_json} is not a valid {model_type} config: {reason}") from None
    try:
        values = adapter.config_from_hf(hf_config)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ConvertError(f"{config_json}: {exc}") from None
    try:
        # The data section's default sequence must fit the imported model's positions.
        seq = min(DataConfig().seq_len, int(values["max_seq_len"]))
        data = {"seq_len": seq, **adapter.import_data}
        job = config_from_dict({"model": values, "data": data}, world_size=1)
    except ConfigError as exc:
        raise ConvertError(f"{config_json} maps to an invalid hyperloom model: {exc}") from None
    weights = _read_hf_weights(src)
    try:
        state = adapter.from_hf(weights, job.model)
    except (KeyError, ValueError, RuntimeError, IndexError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ConvertError(
            f"{src}: weights do not fit the model its config.json describes: {reason}"
        ) from None
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
