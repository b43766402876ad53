"""Reading a Hugging Face model directory: the one path that `hyperloom convert import`, the
`model.preset = "hf:DIR"` architecture and `checkpoint.init_from = "hf:DIR"` share.

`open_hf_dir` reads config.json through transformers' `AutoConfig` (so a key the file leaves
out takes the class's default, as `from_pretrained` would) and maps it with the family's
adapter (`models/<family>/hf.py`), which refuses by name what the model cannot represent; the
tensor names come from the safetensors headers alone, so the architecture costs no weight
reads. `load_hf_weights` then converts the weights in memory and checks every name and shape
against the model. Every failure is a `ConvertError`, one line naming the file and the key.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only in annotations: `hyperloom config` must not import it
    import torch

    from hyperloom.config import JobConfig, ModelConfig

log = logging.getLogger("hyperloom.convert")


class ConvertError(ValueError):
    """A directory or checkpoint cannot be converted; the message says why."""


# What an adapter may raise for a config or weights it cannot take (its messages name the key).
ADAPTER_ERRORS = (ValueError, TypeError, AttributeError, KeyError, RuntimeError, IndexError)


@dataclass(frozen=True)
class HFAdapter:
    """One family's Hugging Face mapping."""

    model_types: tuple[str, ...]  # the config.json "model_type" values it reads
    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    # (weights, model config, transformers config) -> hyperloom weights
    from_hf: Callable[[dict[str, torch.Tensor], Any, Any], dict[str, torch.Tensor]]
    hf_config: Callable[[Any], Any]
    # (transformers config, the checkpoint's tensor names) -> model-section values
    config_from_hf: Callable[[Any, list[str]], dict[str, Any]]
    # The [data] values an imported run's config needs beyond the defaults (a vlm: images).
    import_data: dict[str, Any] = field(default_factory=dict)


def adapters() -> dict[str, HFAdapter]:
    from hyperloom.models.deepseek import hf as ds
    from hyperloom.models.llama import hf as ll
    from hyperloom.models.vlm import hf as vl

    return {
        "llama": HFAdapter(
            ("llama", "qwen3"),  # qwen3: a Llama with qk-norm (model.qk_norm)
            lambda state, cfg: ll.to_hf_state_dict(state),
            lambda state, cfg, hf: ll.from_hf_state_dict(state, cfg),
            ll.hf_config,
            ll.config_from_hf,
        ),
        "deepseek": HFAdapter(
            ("deepseek_v3", "deepseek_v2"),  # sigmoid routing / softmax routing
            ds.to_hf_state_dict,
            lambda state, cfg, hf: ds.from_hf_state_dict(state, cfg, ds.rope_interleaved(hf)),
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


def read_json(path: Path, what: str) -> dict[str, Any]:
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


def weight_files(hf_dir: Path) -> list[str]:
    """The safetensors files of a directory: the index's, or model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, "an object with a weight_map").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ConvertError(f"{index} has no weight_map of tensor names to file names")
        return sorted(set(weight_map.values()))
    if (hf_dir / "model.safetensors").exists():
        return ["model.safetensors"]
    raise ConvertError(
        f"{hf_dir} has no model.safetensors (or model.safetensors.index.json); "
        f"only safetensors checkpoints are read"
    )


def _header_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(size, 100_000_000)))
    except (OSError, struct.error, ValueError) as exc:
        raise ConvertError(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path} is not a readable safetensors file: its header is no object")
    return [n for n in header if n != "__metadata__"]


@dataclass(frozen=True)
class HFDir:
    """A Hugging Face model directory, read as far as its architecture."""

    path: Path
    model_type: str
    adapter: HFAdapter
    config: Any  # the transformers config
    values: dict[str, Any]  # the model section it maps to


def open_hf_dir(hf_dir: str | os.PathLike) -> HFDir:
    """config.json read and mapped (see the module doc); ConvertError for anything else."""
    src = Path(hf_dir)
    config_json = src / "config.json"
    if not config_json.is_file():
        raise ConvertError(f"{src} is not a Hugging Face model directory (no config.json)")
    hf_raw = read_json(config_json, "a Hugging Face model config (an object)")
    model_type = hf_raw.get("model_type")
    by_type = {t: a for a in adapters().values() for t in a.model_types}
    if not isinstance(model_type, str) or model_type not in by_type:
        raise ConvertError(
            f"{config_json}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(by_type))}"
        )
    from transformers import AutoConfig

    adapter = by_type[model_type]
    try:
        hf_config = AutoConfig.from_pretrained(str(src))
    except Exception as exc:  # transformers' checks raise ValueError, TypeError, its own kinds
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise ConvertError(f"{config_json} is not a valid {model_type} config: {reason}") from None
    names = [n for f in weight_files(src) for n in _header_names(src / f)]
    try:
        values = adapter.config_from_hf(hf_config, names)
    except ADAPTER_ERRORS as exc:
        raise ConvertError(f"{config_json}: {error_reason(exc)}") from None
    return HFDir(src, model_type, adapter, hf_config, values)


def error_reason(exc: BaseException) -> str:
    """An exception's message, without the quotes a KeyError puts around it."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def hf_job(hf: HFDir) -> JobConfig:
    """A validated one-process job holding the directory's model (and the defaults else; the
    data section's sequence shortened to fit the model's positions)."""
    from hyperloom.config import ConfigError, DataConfig, config_from_dict

    try:
        seq = min(DataConfig().seq_len, int(hf.values["max_seq_len"]))
        data = {"seq_len": seq, **hf.adapter.import_data}
        return config_from_dict({"model": hf.values, "data": data}, world_size=1)
    except ConfigError as exc:
        raise ConvertError(
            f"{hf.path / 'config.json'} maps to an invalid hyperloom model: {exc}"
        ) from None


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in weight_files(hf_dir):
        try:
            state.update(load_file(str(hf_dir / name)))
        except (OSError, SafetensorError) as exc:
            raise ConvertError(
                f"{hf_dir / name} is not a readable safetensors file: {exc}"
            ) from None
    return state


def load_hf_weights(hf: HFDir, model: ModelConfig) -> dict[str, torch.Tensor]:
    """The directory's weights under hyperloom names for `model` (the architecture it maps
    to), every name and shape checked against that model."""
    from hyperloom.models.registry import build_model

    try:
        state = hf.adapter.from_hf(read_weights(hf.path), model, hf.config)
    except ADAPTER_ERRORS as exc:
        raise ConvertError(
            f"{hf.path}: weights do not fit the model its config.json describes: {error_reason(exc)}"
        ) from None
    expected = {n: tuple(p.shape) for n, p in build_model(model).state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
        raise ConvertError(
            f"{hf.path}: weights do not fit the model its config.json describes: missing "
            f"{missing[:4]}, unexpected {extra[:4]}, wrong shape {wrong[:4]}"
        )
    return state


# Keys an init_from may set apart from the directory's: the RoPE tables' length (positions
# below both lengths rotate alike) and the init of weights that are all loaded anyway.
_FREE_KEYS = ("max_seq_len", "init_std")


def architecture_differences(job: ModelConfig, hf: ModelConfig, keys) -> list[str]:
    """'model.KEY: job A, directory B' for each mapped key on which the two models differ in
    effect (RoPE compared by the scaling in effect; a vlm's decoder by its family)."""
    effective = {
        "family": lambda m: m.decoder_family,
        "rope_type": lambda m: m.rope_kind,
        "yarn_attn_factor": lambda m: m.rope_attention_factor,
    }
    out = []
    for key in keys:
        if key in _FREE_KEYS:
            continue
        read = effective.get(key, lambda m, k=key: getattr(m, k))
        if read(job) != read(hf):
            out.append(f"model.{key}: job {read(job)!r}, directory {read(hf)!r}")
    return out


def hf_preset_values(path: str) -> dict[str, Any]:
    """The model section of `model.preset = "hf:PATH"`: PATH's config.json, mapped."""
    return dict(open_hf_dir(path).values)


def hf_source(init_from: str) -> Path | None:
    """The Hugging Face directory that `checkpoint.init_from` names: "hf:PATH", or a bare
    directory holding config.json and safetensors weights (hyperloom's own checkpoints hold
    config.toml); None for a hyperloom checkpoint or run."""
    if init_from.startswith("hf:"):
        return Path(init_from[3:])
    path = Path(init_from)
    has_weights = any(path.glob("*.safetensors")) if path.is_dir() else False
    if (path / "config.json").is_file() and has_weights:
        return path
    return None


def hf_tokenizer(hf_dir: Path, eos_token: str) -> tuple[str, str] | None:
    """(tokenizer.json path, eos token) of a Hugging Face directory, None without one. The eos
    token stays `eos_token` when the tokenizer has it, else it is the directory's own
    (tokenizer_config.json's eos_token, or config.json's eos_token_id)."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own kinds
        raise ConvertError(f"{path} is not a readable tokenizer.json: {exc}") from None
    if tok.token_to_id(eos_token) is not None:
        return str(path), eos_token
    own = None
    if (hf_dir / "tokenizer_config.json").is_file():
        own = read_json(hf_dir / "tokenizer_config.json", "an object").get("eos_token")
        own = own.get("content") if isinstance(own, dict) else own
    if not isinstance(own, str):
        eos_id = read_json(hf_dir / "config.json", "an object").get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        own = tok.id_to_token(eos_id) if isinstance(eos_id, int) else None
    return str(path), own if isinstance(own, str) else eos_token
